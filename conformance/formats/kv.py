"""KV page layouts: pagecheck's pools `[P, Hkv, ps, D]` to each layout other systems use, and back.

| layout       | arrays the kernel gets                            | used by                            |
|--------------|---------------------------------------------------|------------------------------------|
| `hnd`        | `key_cache`, `value_cache` `[P, Hkv, ps, D]`      | pagecheck, FlashInfer HND          |
| `nhd`        | `key_cache`, `value_cache` `[P, ps, Hkv, D]`      | FlashAttention, FlashInfer NHD, vLLM Triton |
| `kv_hnd`     | `kv_cache` `[P, 2, Hkv, ps, D]` (0: K, 1: V)      | FlashInfer's paired cache, HND      |
| `kv_nhd`     | `kv_cache` `[P, 2, ps, Hkv, D]`                   | FlashInfer's paired cache, NHD      |
| `kv_last`    | `kv_cache` `[P, Hkv, ps, 2D]` (K, then V)         | vLLM CPU's logical view             |
| `vllm_split` | `key_cache` `[P, Hkv, D/x, ps, x]`, `value_cache` `[P, Hkv, D, ps]`; x = 16 bytes / itemsize | vLLM CUDA's paged_attention_v1/v2 |
| `amx_packed` | `key_cache`, `value_cache` `[P, Hkv, ps, D]`, each head's `[ps, D]` slice in the AMX tiles' operand order (below) | pagecheck's serving pools, `PagePool(layout="amx_packed")` |

`amx_packed` keeps the shape and the page/head order and permutes each head's slice
(page_size and D multiples of 32; impl/csrc/packed_layout.h is the kernel's statement of
the same order): K as `[ps/16, D/32, 16, 16, 2]`, key block / d step / d pair / key /
element of the pair (the B operand of S = Q K^T for 16 keys), V as `[ps/32, D/16, 16, 16,
2]`, 32-key slab / d tile / key pair / d / key of the pair (the B operand of O = P V).

Every conversion is a pure re-indexing in MLX (any dtype, bf16 included): element
`pages[p, g, s, d]` of either pool is the same element in the converted arrays, so NaN in
free pages and unused slots travels with it.

Quantized pools (contract/kv_format.py) convert the same way, as their codes (uint8 bit
patterns of fp8, int8): vllm_split's x counts 16 one-byte codes. Their scales go to the
kernel as `k_scale` and `v_scale`, each indexed like its cache without the head dim, so a
per-token scale stays beside its slot; per-tensor `[]` and per-head `[Hkv]` scales are
the same in every layout:

| layout                                      | per-token scale `[P, Hkv, ps]` becomes |
|---------------------------------------------|----------------------------------------|
| `hnd`, `kv_hnd`, `kv_last`, `vllm_split`    | `[P, Hkv, ps]` (as is)                 |
| `nhd`, `kv_nhd`                             | `[P, ps, Hkv]` (slot-major, like the cache) |
"""

from __future__ import annotations

import mlx.core as mx

from .errors import NotExpressible

SPLIT_BYTES = 16  # vLLM CUDA: x elements of the key cache's innermost axis make 16 bytes


def split_x(dtype) -> int:
    return SPLIT_BYTES // dtype.size


def pack(layout: str, key_pages: mx.array, value_pages: mx.array) -> dict:
    """The layout's arrays (by the kernel's argument names) from pagecheck pools."""
    if layout == "hnd":
        return {"key_cache": key_pages, "value_cache": value_pages}
    if layout == "nhd":
        return {"key_cache": key_pages.swapaxes(1, 2), "value_cache": value_pages.swapaxes(1, 2)}
    if layout == "kv_hnd":
        return {"kv_cache": mx.stack([key_pages, value_pages], axis=1)}
    if layout == "kv_nhd":
        return {"kv_cache": mx.stack([key_pages.swapaxes(1, 2), value_pages.swapaxes(1, 2)], axis=1)}
    if layout == "kv_last":
        return {"kv_cache": mx.concatenate([key_pages, value_pages], axis=-1)}
    if layout == "amx_packed":
        return {"key_cache": _packed_keys(key_pages), "value_cache": _packed_values(value_pages)}
    if layout == "vllm_split":
        P, hkv, ps, D = key_pages.shape
        x = split_x(key_pages.dtype)
        if D % x:
            raise ValueError(f"vllm_split needs D % {x} == 0 for {key_pages.dtype}, got D = {D}")
        keys = key_pages.reshape(P, hkv, ps, D // x, x).transpose(0, 1, 3, 2, 4)
        return {"key_cache": keys, "value_cache": value_pages.swapaxes(2, 3)}
    raise ValueError(f"unknown KV layout {layout!r}")


def unpack(layout: str, arrays: dict) -> tuple[mx.array, mx.array]:
    """pagecheck pools `(key_pages, value_pages)` from the layout's arrays (the inverse of pack)."""
    if layout == "hnd":
        return arrays["key_cache"], arrays["value_cache"]
    if layout == "nhd":
        return arrays["key_cache"].swapaxes(1, 2), arrays["value_cache"].swapaxes(1, 2)
    if layout == "kv_hnd":
        kv = arrays["kv_cache"]
        return kv[:, 0], kv[:, 1]
    if layout == "kv_nhd":
        kv = arrays["kv_cache"]
        return kv[:, 0].swapaxes(1, 2), kv[:, 1].swapaxes(1, 2)
    if layout == "kv_last":
        kv = arrays["kv_cache"]
        D = kv.shape[-1] // 2
        return kv[..., :D], kv[..., D:]
    if layout == "amx_packed":
        return _packed_keys(arrays["key_cache"], back=True), _packed_values(arrays["value_cache"], back=True)
    if layout == "vllm_split":
        keys, values = arrays["key_cache"], arrays["value_cache"]
        P, hkv, chunks, ps, x = keys.shape
        return keys.transpose(0, 1, 3, 2, 4).reshape(P, hkv, ps, chunks * x), values.swapaxes(2, 3)
    raise ValueError(f"unknown KV layout {layout!r}")


PACKED_MULTIPLE = 32  # amx_packed: page_size and head dims in whole 32-key V slabs and 32-element d steps


def _permute_slices(pages: mx.array, split: tuple, order: tuple, back: bool) -> mx.array:
    """Each `[ps, D]` slice of `pages` viewed as `split` (its axes, slot ones first) and
    permuted into `order`, or with `back` the inverse: `pages` holds the permuted view."""
    P, hkv, ps, D = pages.shape
    if ps % PACKED_MULTIPLE or D % PACKED_MULTIPLE:
        raise NotExpressible(f"page_size {ps} and head dim {D} in layout amx_packed (multiples of "
                             f"{PACKED_MULTIPLE})")
    if back:
        inverse = tuple(order.index(a) for a in range(len(order)))
        permuted = tuple(split[a] for a in order)
        return pages.reshape(P, hkv, *permuted).transpose(0, 1, *(2 + a for a in inverse)).reshape(P, hkv, ps, D)
    return pages.reshape(P, hkv, *split).transpose(0, 1, *(2 + a for a in order)).reshape(P, hkv, ps, D)


def _packed_keys(pages: mx.array, back: bool = False) -> mx.array:
    """slot = 16 blk + k, d = 32 st + 2 p + e  ->  [blk, st, p, k, e]"""
    ps, D = pages.shape[2:]
    return _permute_slices(pages, (ps // 16, 16, D // 32, 16, 2), (0, 2, 3, 1, 4), back)


def _packed_values(pages: mx.array, back: bool = False) -> mx.array:
    """slot = 32 u + 2 i + e, d = 16 t + dd  ->  [u, t, i, dd, e]"""
    ps, D = pages.shape[2:]
    return _permute_slices(pages, (ps // 32, 16, 2, D // 16, 16), (0, 3, 1, 4, 2), back)


SLOT_MAJOR = ("nhd", "kv_nhd")  # layouts whose slots come before the heads


def pack_scale(layout: str, scale, pool_shape: tuple):
    """A scale in the layout's order: a per-token `[P, Hkv, ps]` one (`pool_shape` the key
    pool's `(P, Hkv, ps, D)`) slot-major where the cache is; any other as it is."""
    if layout not in SLOT_MAJOR or not isinstance(scale, mx.array) or scale.ndim != 3:
        return scale
    if tuple(scale.shape) != tuple(pool_shape[:3]):
        # a malformed scale transposed could take the layout's valid shape: a rejected call made valid
        raise NotExpressible(f"a scale of shape {tuple(scale.shape)} (not the per-token [P, Hkv, ps] = "
                             f"{tuple(pool_shape[:3])}) has no faithful image in layout {layout}")
    return scale.swapaxes(1, 2)


def unpack_scale(layout: str, scale):
    """The inverse of pack_scale: a per-token scale back to `[P, Hkv, ps]`."""
    if layout not in SLOT_MAJOR or not isinstance(scale, mx.array) or scale.ndim != 3:
        return scale
    return scale.swapaxes(1, 2)


def copies(layout: str) -> int:
    """Pool-sized copies a conversion makes (the memory estimate: Capabilities.extra_memory)."""
    return 0 if layout == "hnd" else 1
