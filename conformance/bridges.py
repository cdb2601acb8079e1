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
| quantized pages  | the codes as they are: uint8 bit patterns for fp8, int8 | fp8 in torch's own dtype (`torch.float8_e4m3fn`, `torch.float8_e5m2`: a `.view` of the uint8 codes, no conversion; uint8 where torch has none); int8 as `torch.int8` |
| `k_scale`, `v_scale` | NumPy arrays in their dtype (float32); a float as a 0-d float32 array | torch tensors on `device` in their dtype (float32, never widened); a float as a 0-d float32 tensor |
| `kv_dtype`       | passed through, as pagecheck names it, or as the kernel does (`kv_dtype_names`) | the same |
| call             | the contract's signature, or the native keywords of the declared format (conformance/formats) | the same |
| result           | a NumPy array, cast once to the query's dtype   | a torch tensor, synchronized, copied back in its own dtype (cast only under `widens_to`) |
| `(out, lse)`     | out as above; lse a NumPy array, back as float32 | out as above; lse back in its own dtype (float32 under `widens_to`) |
| errors           | the kernel's own exceptions pass through untouched (declare them in `error_types`) | the same |

With `return_lse=True` a kernel returns `(out, lse)`; the pair comes back converted, the
lse in pagecheck's conventions (natural log, `-inf` for an empty row, ALiBi at `j - p`;
conformance/formats/conventions.py converts what the kernel declares otherwise) and, from
packed queries, as `[B, Hq, L]` (`-inf` where a request has no row).

Why the torch bridge hands fp8 pages as torch's fp8 dtypes: a torch kernel reads its cache's
format from the tensor (vLLM's Triton kernels, FlashInfer, FlashAttention 3 check
`key_cache.dtype`), and a view moves no byte, so the codes it reads are pagecheck's. A
scale is always an array of the framework (0-d per tensor), as vLLM's `k_scale` tensors
are; a kernel wanting a float calls `float()` on it. A pool or scale that breaks the
contract (a rejection check: fp8 codes in float32 pools, a float64 scale) goes over as
it is, so the kernel's own check sees it. MLX kernels get everything as given.

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
POOLS = ("key_pages", "value_pages", "key_cache", "value_cache", "kv_cache")  # what holds the KV codes
SCALES = ("k_scale", "v_scale")
FP8 = ("float8_e4m3fn", "float8_e5m2")  # formats torch has a dtype of, under the same name


def _scalar(x) -> bool:
    """A per-tensor scale given as a Python number (a bool is no scale: left for the kernel)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


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

    def pool(self, name, x, kv_dtype):
        return x

    def scale(self, name, x):
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

    def pool(self, name, x, kv_dtype):
        return self.to(name, x)  # uint8 / int8 codes stay as they are (NumPy has no fp8)

    def scale(self, name, x):
        if _scalar(x):
            return np.array(x, dtype=np.float32)
        return self.to(name, x) if isinstance(x, mx.array) else x


class TorchBridge:
    copies = 1  # the host copy the tensors are made from

    def __init__(self, device: str, widens_to: str | None):
        import torch

        if device == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("from_torch(device='cuda'): torch sees no CUDA device on this machine")
        self.torch, self.name, self.device = torch, "torch", device
        self.widen = getattr(torch, widens_to) if widens_to else None

    def to(self, name, x, widen: bool = True):
        torch = self.torch
        _require_mlx(name, x)
        widen = self.widen if widen else None
        if x.size == 0:  # NumPy hands a 0-element array strides of 0, which layout checks refuse
            return torch.empty(tuple(x.shape), dtype=self._dtype(x.dtype, widen), device=self.device)
        if x.dtype == mx.bfloat16:  # NumPy has no bfloat16: move the bits, then reinterpret them
            t = torch.from_numpy(np.array(x.view(mx.int16))).view(torch.bfloat16)
        else:
            t = torch.from_numpy(np.array(x))
        if widen is not None and t.is_floating_point():
            t = t.to(widen)
        return t.to(self.device)

    def _dtype(self, dtype, widen):
        if widen is not None and mx.issubdtype(dtype, mx.floating):
            return widen
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

    def pool(self, name, x, kv_dtype):
        """A pool as a tensor; fp8 codes (uint8) viewed as torch's own fp8 dtype of the call's
        format, bit for bit. Anything else (int8, a float pool, a pool of the wrong dtype
        in a rejection check) keeps its dtype."""
        t = self.to(name, x)
        fp8 = getattr(self.torch, kv_dtype, None) if kv_dtype in FP8 else None
        if isinstance(fp8, self.torch.dtype) and t.dtype == self.torch.uint8:
            return t.view(fp8)
        return t

    def scale(self, name, x):
        """A scale as a tensor on the device in its own dtype (float32: never widened), a
        Python number as a 0-d float32 tensor; anything else as given (the kernel rejects it)."""
        torch = self.torch
        if _scalar(x):
            return torch.tensor(float(x), dtype=torch.float32, device=self.device)
        if isinstance(x, mx.array):
            return self.to(name, x, widen=False)
        if isinstance(x, np.ndarray):
            return torch.from_numpy(np.array(x)).to(self.device)
        return x


_POSITIONAL = ("query", "key_pages", "value_pages", "block_table", "context_lens")


def _convert(bridge, name, x, kv_dtype):
    """One keyword argument in the bridge's framework (by its name: pools, scales, v2
    option arrays, other arrays); a non-array passes as given."""
    if name in SCALES:
        return bridge.scale(name, x)
    if name in OPTION_ARRAYS:
        return bridge.option(name, x)
    if not isinstance(x, mx.array):
        return x
    return bridge.pool(name, x, kv_dtype) if name in POOLS else bridge.to(name, x)


def _call(fn, bridge, call):
    """`fn` on the call's arguments, each array in the bridge's framework: the contract's
    positional arrays must be mlx (the type rule), the v2 option arrays may be NumPy; the
    pools as the call's KV format says (`call.kv_dtype`, pagecheck's name)."""
    args = [bridge.pool(n, x, call.kv_dtype) if n in POOLS else bridge.to(n, x)
            for n, x in zip(_POSITIONAL, call.args[:5])] + list(call.args[5:])
    kwargs = {k: _convert(bridge, k, v, call.kv_dtype) for k, v in call.kwargs.items()}
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
