"""Foreign formats: one contract call (REFERENCE.md section 1) as a kernel's native call.

A kernel that declares any of `layout`, `page_table`, `query_packing` or
`window_convention` (conformance/capabilities.py) is called with keyword arguments:

| declared                         | keyword arguments the kernel gets                              |
|----------------------------------|----------------------------------------------------------------|
| `query_packing` (queries.py)     | `query` `[B, Hq, L, D]`, or `query` `[T, Hq, D]` + `cu_seqlens_q` + `max_seqlen_q` |
| `layout` (kv.py)                 | `key_cache` + `value_cache`, or `kv_cache`, in the layout's shape |
| `page_table` (tables.py)         | `block_table` + `seq_lens`, or `kv_indptr` + `kv_indices` + `kv_last_page_len` |
| always                           | `page_size` int, `scale` float (D ** -0.5 when None), `causal` bool |
| `window_convention` (conventions.py) | `window`, `window_size` or `window_left`                   |

It returns its output in its query packing. `native(...)` builds the call and the
function that brings the output back; `native_packed(...)` does the same for a batch of
mixed query lengths (varlen kernels only). A call the format cannot express faithfully
raises `NotExpressible`, a skip with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from . import conventions, kv, queries, tables
from .errors import NotExpressible

__all__ = ["NativeCall", "NotExpressible", "conventions", "kv", "native", "native_packed", "queries", "tables"]


@dataclass(frozen=True)
class NativeCall:
    kwargs: dict  # the kernel's keyword arguments (mlx arrays and Python values)
    output: object  # callable: the kernel's output (mlx) -> the contract's [B, Hq, L, D]


def _well_formed(query, key_pages, value_pages, block_table, context_lens, page_size) -> None:
    """The structure every conversion relies on; a malformed call (a rejection check of
    the contract's own shapes) has no native image."""
    arrays = {"query": (query, 4), "key_pages": (key_pages, 4), "value_pages": (value_pages, 4),
              "block_table": (block_table, 2), "context_lens": (context_lens, 1)}
    for name, (x, rank) in arrays.items():
        if not isinstance(x, mx.array) or x.ndim != rank:
            raise NotExpressible(f"{name} is not a {rank}-D mlx array; a malformed call has no native image")
    if tuple(key_pages.shape) != tuple(value_pages.shape):
        raise NotExpressible("key and value pools of different shapes")
    if block_table.shape[0] != query.shape[0] or context_lens.shape[0] != query.shape[0]:
        raise NotExpressible("metadata whose batch differs from the query's")
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size != key_pages.shape[2]:
        raise NotExpressible(f"page_size={page_size!r} disagrees with the pool's {key_pages.shape[2]}")
    if query.shape[-1] != key_pages.shape[-1] or key_pages.shape[1] == 0 or query.shape[1] % key_pages.shape[1]:
        raise NotExpressible("head dims or head counts that disagree")
    for name in ("block_table", "context_lens"):
        if arrays[name][0].dtype not in (mx.int32, mx.int64, mx.uint32):
            raise NotExpressible(f"{name} of dtype {arrays[name][0].dtype}")


def _common(caps, key_pages, value_pages, block_table, context_lens, page_size, scale, mask, window, D):
    if scale is None:
        scale = D ** -0.5
    if caps.layout.startswith("kv_") and key_pages.dtype != value_pages.dtype:
        raise NotExpressible(f"key and value pools of different dtypes in one {caps.layout} tensor")
    if caps.layout == "vllm_split" and D % kv.split_x(key_pages.dtype):
        raise NotExpressible(f"head dim {D} in layout vllm_split (x = {kv.split_x(key_pages.dtype)})")
    return {**kv.pack(caps.layout, key_pages, value_pages),
            **tables.pack(caps.page_table, block_table, context_lens, page_size),
            "page_size": page_size, "scale": scale, "causal": conventions.causal_flag(mask),
            **conventions.window_args(caps.window_convention, window, mask)}


def native(caps, query, key_pages, value_pages, block_table, context_lens, page_size, *,
           scale=None, mask="causal", window=None) -> NativeCall:
    """The native call of a padded contract call."""
    _well_formed(query, key_pages, value_pages, block_table, context_lens, page_size)
    L = query.shape[2]
    common = _common(caps, key_pages, value_pages, block_table, context_lens, page_size, scale, mask, window,
                     query.shape[-1])
    if caps.query_packing == "padded":
        return NativeCall({"query": query, **common}, lambda out: out)
    packed = queries.pack(query, queries.query_lens(context_lens, L))
    return NativeCall({**packed, **common}, lambda out: queries.unpack(out, packed["cu_seqlens_q"], L))


def native_packed(caps, query, cu_seqlens_q, key_pages, value_pages, block_table, context_lens, page_size, *,
                  scale=None, mask="causal", window=None) -> dict:
    """The native keyword arguments of a batch of mixed query lengths: `query` `[T, Hq, D]`
    packed by `cu_seqlens_q`; the kernel returns `[T, Hq, D]` as is."""
    if caps.query_packing != "varlen":
        raise NotExpressible("mixed query lengths in one batch need query_packing='varlen' "
                             "(the padded form gives every request the same L)")
    lens = np.diff(np.array(cu_seqlens_q)).astype(np.int32)
    max_len = int(lens.max(initial=0))
    return {"query": query, "cu_seqlens_q": cu_seqlens_q, "max_seqlen_q": max_len,
            **_common(caps, key_pages, value_pages, block_table, context_lens, page_size, scale, mask, window,
                      query.shape[-1])}
