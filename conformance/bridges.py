"""Bridges: kernels in NumPy or torch (or MLX in a foreign format) behind the mlx contract.

    from conformance.bridges import from_torch
    paged_attention = from_torch(my_kernel, device="cpu", layout="nhd", query_packing="varlen",
                                 window_convention="flash", dtypes=["float32", "float16"],
                                 error_types=[RuntimeError, ValueError])
    # pytest -m correctness --impl mymodule:paged_attention

| boundary         | `from_numpy(fn, **caps)`                        | `from_torch(fn, device, **caps)`                     |
|------------------|-------------------------------------------------|------------------------------------------------------|
| arrays in        | NumPy copies; bfloat16 widened exactly to float32 (NumPy has none) | torch tensors on `device`, in their own dtype (bf16 stays bf16); `widens_to="float32"` declares a widening |
| v2 arrays in     | `alibi_slopes`, `sinks` as NumPy arrays too (a NumPy one given stays NumPy) | torch tensors on `device` (a NumPy one given: as a tensor, its dtype kept) |
| call             | the contract's signature, or the native keywords of the declared format (conformance/formats) | the same |
| result           | a NumPy array, cast once to the query's dtype   | a torch tensor, synchronized, copied back in its own dtype (cast only under `widens_to`) |
| `(out, lse)`     | out as above; lse a NumPy array, back as float32 | out as above; lse back in its own dtype (float32 under `widens_to`) |
| errors           | the kernel's own exceptions pass through untouched (declare them in `error_types`) | the same |

With `return_lse=True` a kernel returns `(out, lse)`; the pair comes back converted, the
lse in pagecheck's conventions (natural log, `-inf` for an empty row, ALiBi at `j - p`;
conformance/formats/conventions.py converts what the kernel declares otherwise) and, from
packed queries, as `[B, Hq, L]` (`-inf` where a request has no row).

An MLX kernel that declares a format or a convention in its `pagecheck_capabilities` goes
through the same conversion (`contract_view` with the MLX bridge; `conformance.implementation.load`
does it). The result of every bridge has the contract's signature, a `packed` entry for
batches of mixed query lengths when its queries are varlen, and the declaration, with
`framework`, `device` and the bridge's own copies added to `extra_memory`.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np

from . import formats
from .capabilities import Capabilities

OPTION_ARRAYS = ("alibi_slopes", "sinks")  # contract-v2 arrays: MLX, or NumPy (the built-in takes both)


def _require_mlx(name, x) -> None:
    """The contract's type rule, as the NumPy and torch bridges enforce it for their kernels."""
    if not isinstance(x, mx.array):
        raise TypeError(f"{name} must be an mlx.core.array, got {type(x).__name__}")


class MlxBridge:
    name, device, copies = "mlx", "cpu", 0

    def to(self, name, x):
        return x

    def back(self, out, dtype):
        return out

    def back_lse(self, lse):
        return lse

    def option(self, name, x):
        return x


class NumpyBridge:
    name, device, copies = "numpy", "cpu", 2  # a float32 copy of bf16 pools is twice their bytes

    def to(self, name, x):
        _require_mlx(name, x)
        return np.array(x.astype(mx.float32) if x.dtype == mx.bfloat16 else x)

    def back(self, out, dtype):
        if not isinstance(out, np.ndarray):
            raise TypeError(f"the kernel returned {type(out).__name__}, expected a NumPy array")
        return mx.array(out.astype(np.float32) if out.dtype == np.float64 else out).astype(dtype)

    def back_lse(self, lse):
        if not isinstance(lse, np.ndarray):
            raise TypeError(f"the kernel returned an lse of type {type(lse).__name__}, expected a NumPy array")
        return mx.array(lse.astype(np.float32))

    def option(self, name, x):
        return self.to(name, x) if isinstance(x, mx.array) else x


class TorchBridge:
    copies = 1  # the host copy the tensors are made from

    def __init__(self, device: str, widens_to: str | None):
        import torch

        if device == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("from_torch(device='cuda'): torch sees no CUDA device on this machine")
        self.torch, self.name, self.device = torch, "torch", device
        self.widen = getattr(torch, widens_to) if widens_to else None

    def to(self, name, x):
        torch = self.torch
        _require_mlx(name, x)
        if x.size == 0:  # NumPy hands a 0-element array strides of 0, which layout checks refuse
            return torch.empty(tuple(x.shape), dtype=self._dtype(x.dtype), device=self.device)
        if x.dtype == mx.bfloat16:  # NumPy has no bfloat16: move the bits, then reinterpret them
            t = torch.from_numpy(np.array(x.view(mx.int16))).view(torch.bfloat16)
        else:
            t = torch.from_numpy(np.array(x))
        if self.widen is not None and t.is_floating_point():
            t = t.to(self.widen)
        return t.to(self.device)

    def _dtype(self, dtype):
        if self.widen is not None and mx.issubdtype(dtype, mx.floating):
            return self.widen
        return getattr(self.torch, str(dtype).removeprefix("mlx.core."))

    def _host(self, t):
        """A torch tensor as an mlx array of its own dtype (bf16 moved as bits)."""
        torch = self.torch
        if t.is_cuda:
            torch.cuda.synchronize()
        t = t.detach().cpu().contiguous()
        if t.dtype == torch.bfloat16:
            return mx.array(t.view(torch.int16).numpy()).view(mx.bfloat16)
        return mx.array(t.numpy())

    def back(self, out, dtype):
        if not isinstance(out, self.torch.Tensor):
            raise TypeError(f"the kernel returned {type(out).__name__}, expected a torch.Tensor")
        result = self._host(out)
        return result.astype(dtype) if self.widen is not None else result

    def back_lse(self, lse):
        if not isinstance(lse, self.torch.Tensor):
            raise TypeError(f"the kernel returned an lse of type {type(lse).__name__}, expected a torch.Tensor")
        result = self._host(lse)
        return result.astype(mx.float32) if self.widen is not None else result

    def option(self, name, x):
        if isinstance(x, np.ndarray):  # a NumPy option array (the built-in takes one): as a tensor
            return self.torch.from_numpy(np.array(x)).to(self.device)
        return self.to(name, x) if isinstance(x, mx.array) else x


_POSITIONAL = ("query", "key_pages", "value_pages", "block_table", "context_lens")


def _call(fn, bridge, call):
    """`fn` on the call's arguments, each array in the bridge's framework: the contract's
    positional arrays must be mlx (the type rule), the v2 option arrays may be NumPy."""
    args = [bridge.to(n, x) for n, x in zip(_POSITIONAL, call.args[:5])] + list(call.args[5:])
    kwargs = {k: bridge.option(k, v) if k in OPTION_ARRAYS else bridge.to(k, v) if isinstance(v, mx.array) else v
              for k, v in call.kwargs.items()}
    return fn(*args, **kwargs)


def _back(bridge, result, dtype):
    """The kernel's result in MLX: the output in the query's dtype (as the bridge does it),
    an lse of `(out, lse)` as the bridge brings an lse back."""
    if isinstance(result, (tuple, list)) and len(result) == 2:
        return bridge.back(result[0], dtype), bridge.back_lse(result[1])
    return bridge.back(result, dtype)


def contract_view(fn, spec: dict, bridge):
    """`fn` (native in the declared format and the bridge's framework) as a callable with
    the contract's signature."""
    caps = Capabilities.declared(spec)  # a bad declaration fails here, at import of the kernel's module

    @functools.wraps(fn)
    def paged_attention(query, key_pages, value_pages, block_table, context_lens, page_size, **options):
        call = formats.native(caps, query, key_pages, value_pages, block_table, context_lens, page_size, **options)
        return call.output(_back(bridge, _call(fn, bridge, call), query.dtype))

    def packed(query, cu_seqlens_q, key_pages, value_pages, block_table, context_lens, page_size, **options):
        call = formats.native_packed(caps, query, cu_seqlens_q, key_pages, value_pages, block_table, context_lens,
                                     page_size, **options)
        return call.output(_back(bridge, _call(fn, bridge, call), query.dtype))

    if caps.query_packing == "varlen":
        paged_attention.packed = packed
    layout_copies = formats.kv.copies(caps.layout) if caps.native_call else 0
    paged_attention.pagecheck_capabilities = {
        **spec, "framework": bridge.name, "device": bridge.device,
        "extra_memory": caps.extra_memory + bridge.copies + layout_copies}
    paged_attention.pagecheck_contract_form = True
    return paged_attention


def from_numpy(fn, **capabilities):
    """The NumPy kernel `fn` as an implementation of the contract (see the module table)."""
    return contract_view(fn, {**(getattr(fn, "pagecheck_capabilities", None) or {}), **capabilities},
                         NumpyBridge())


def from_torch(fn, device: str = "cpu", **capabilities):
    """The torch kernel `fn` on `device` ("cpu" or "cuda") as an implementation of the contract."""
    spec = {**(getattr(fn, "pagecheck_capabilities", None) or {}), **capabilities}
    if device not in ("cpu", "cuda"):
        raise ValueError(f"from_torch: device must be 'cpu' or 'cuda', got {device!r}")
    return contract_view(fn, spec, TorchBridge(device, spec.get("widens_to")))


def from_mlx(fn, **capabilities):
    """An MLX kernel in a declared foreign format (what `load` does for a declaring kernel)."""
    return contract_view(fn, {**(getattr(fn, "pagecheck_capabilities", None) or {}), **capabilities},
                         MlxBridge())
