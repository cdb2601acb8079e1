"""Foreign formats: one contract call (REFERENCE.md sections 1 and 1b) as a kernel's native call.

A kernel that declares any of `layout`, `page_table`, `query_packing` or
`window_convention` (conformance/capabilities.py) is called with keyword arguments:

| declared                         | keyword arguments the kernel gets                              |
|----------------------------------|----------------------------------------------------------------|
| `query_packing` (queries.py)     | `query` `[B, Hq, L, Dk]`, or `query` `[T, Hq, Dk]` + `cu_seqlens_q` + `max_seqlen_q` |
| `layout` (kv.py)                 | `key_cache` + `value_cache`, or `kv_cache`, in the layout's shape |
| `page_table` (tables.py)         | `block_table` + `seq_lens`, or `kv_indptr` + `kv_indices` + `kv_last_page_len` |
| always                           | `page_size` int, `scale` float (Dk ** -0.5 when None), `causal` bool |
| `window_convention` (conventions.py) | `window`, `window_size` or `window_left`                   |
| contract v2, only when the call sets it | `softcap` float, `alibi_slopes` `[Hq]`, `sinks` `[Hq]`, `return_lse=True` |
| quantized KV, only when the call sets it | `kv_dtype` (the kernel's name of it: `kv_dtype_names`), `k_scale`, `v_scale` (a per-token one in the layout's slot order, kv.py) |

It returns its output in its query packing (`[..., Dv]`), or with `return_lse` the pair
`(out, lse)`: lse `[B, Hq, L]` padded, `[T, Hq]` packed. `native(...)` builds the call
and the function that brings the result back (the lse in pagecheck's conventions,
conventions.py); `native_packed(...)` does the same for a batch of mixed query lengths
(varlen kernels only). A call the format cannot express faithfully raises
`NotExpressible`, a skip with the reason.

A kernel that declares no format key but a convention (`lse_convention`, `empty_lse`,
`alibi_convention`, `kv_dtype_names`) keeps the contract's signature: `native` then gives
that call (`NativeCall.args` positional) and the same conversion back. `NativeCall.kv_dtype`
keeps the call's format under pagecheck's name, for the bridges (torch's own fp8 dtypes).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from contract import ScorePipeline

from . import conventions, kv, queries, tables
from .errors import NotExpressible

__all__ = ["NativeCall", "NotExpressible", "conventions", "kv", "native", "native_packed", "queries", "tables"]
STACKED = ("kv_hnd", "kv_nhd", "kv_last")  # one tensor for K and V: Dv must equal Dk


@dataclass(frozen=True)
class NativeCall:
    kwargs: dict  # the kernel's keyword arguments (mlx arrays and Python values)
    output: object  # callable: the kernel's result (mlx) -> the contract's out, or (out, lse)
    args: tuple = field(default=())  # positional arguments (the contract's own form only)
    kv_dtype: object = None  # the call's kv_dtype as pagecheck names it (the kernel's name may differ)


def _pair(result):
    return isinstance(result, (tuple, list)) and len(result) == 2


def _well_formed(query, key_pages, value_pages, block_table, context_lens, page_size) -> None:
    """The structure every conversion relies on; a malformed call (a rejection check of
    the contract's own shapes) has no native image."""
    arrays = {"query": (query, 4), "key_pages": (key_pages, 4), "value_pages": (value_pages, 4),
              "block_table": (block_table, 2), "context_lens": (context_lens, 1)}
    for name, (x, rank) in arrays.items():
        if not isinstance(x, mx.array) or x.ndim != rank:
            raise NotExpressible(f"{name} is not a {rank}-D mlx array; a malformed call has no native image")
    if tuple(key_pages.shape[:3]) != tuple(value_pages.shape[:3]):
        raise NotExpressible("key and value pools that disagree outside the head dim")
    if block_table.shape[0] != query.shape[0] or context_lens.shape[0] != query.shape[0]:
        raise NotExpressible("metadata whose batch differs from the query's")
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size != key_pages.shape[2]:
        raise NotExpressible(f"page_size={page_size!r} disagrees with the pool's {key_pages.shape[2]}")
    if query.shape[-1] != key_pages.shape[-1] or key_pages.shape[1] == 0 or query.shape[1] % key_pages.shape[1]:
        raise NotExpressible("head dims or head counts that disagree")
    for name in ("block_table", "context_lens"):
        if arrays[name][0].dtype not in (mx.int32, mx.int64, mx.uint32):
            raise NotExpressible(f"{name} of dtype {arrays[name][0].dtype}")


def _options(caps, pipeline: ScorePipeline, pool_shape: tuple) -> dict:
    """The contract-v2 and quantized-KV keywords a call sets (none for a first-contract
    call: a native kernel written before them keeps its signature); a per-token scale in
    the layout's order, the format under the kernel's name."""
    conventions.alibi_expressible(caps.alibi_convention, pipeline)
    v2 = pipeline.kwargs()
    out = {k: v2[k] for k in ("softcap", "alibi_slopes", "sinks", "return_lse") if k in v2}
    return {**out, **_kv_options(caps, v2, lambda scale: kv.pack_scale(caps.layout, scale, pool_shape))}


def _kv_options(caps, kwargs: dict, scale_back=lambda scale: scale) -> dict:
    """`kv_dtype`, `k_scale`, `v_scale` where the call sets them: the format renamed as the
    kernel names it, each scale through `scale_back` (the layout's order)."""
    out = {"kv_dtype": caps.kv_dtype_name(kwargs["kv_dtype"])} if "kv_dtype" in kwargs else {}
    return {**out, **{k: scale_back(kwargs[k]) for k in ("k_scale", "v_scale") if k in kwargs}}


def _common(caps, key_pages, value_pages, block_table, context_lens, page_size, pipeline, D):
    scale = D ** -0.5 if pipeline.scale is None else pipeline.scale
    if caps.layout.startswith("kv_") and key_pages.dtype != value_pages.dtype:
        raise NotExpressible(f"key and value pools of different dtypes in one {caps.layout} tensor")
    if caps.layout in STACKED and key_pages.shape[-1] != value_pages.shape[-1]:
        raise NotExpressible(f"Dk = {key_pages.shape[-1]} != Dv = {value_pages.shape[-1]} in one {caps.layout} "
                             f"tensor (K and V share its head dim)")
    if caps.layout == "vllm_split" and D % kv.split_x(key_pages.dtype):
        raise NotExpressible(f"head dim {D} in layout vllm_split (x = {kv.split_x(key_pages.dtype)})")
    return {**kv.pack(caps.layout, key_pages, value_pages),
            **tables.pack(caps.page_table, block_table, context_lens, page_size),
            "page_size": page_size, "scale": scale, "causal": conventions.causal_flag(pipeline.mask),
            **conventions.window_args(caps.window_convention, pipeline.window, pipeline.mask),
            **_options(caps, pipeline, tuple(key_pages.shape))}


def _back(caps, pipeline, result, out_back, lse_back, rows):
    """The kernel's result in the contract's form: the output through `out_back`, an lse
    through `lse_back` and then pagecheck's conventions (`rows()`: where its entries sit)."""
    if not _pair(result):
        return out_back(result)
    out, lse = result
    lse = lse_back(lse) if isinstance(lse, mx.array) else lse
    return out_back(out), conventions.lse_back(caps, lse, pipeline, rows())


def _contract_form(caps, query, key_pages, value_pages, block_table, context_lens, page_size, pipeline):
    """The contract's own call (no format key declared): only the lse's conventions are
    converted back, and a call whose output differs under the declared ALiBi convention
    is not made. A malformed call passes as given (the kernel's rejection is checked)."""
    conventions.alibi_expressible(caps.alibi_convention, pipeline)

    def rows():
        return conventions.Rows.padded(context_lens, query.shape[2])

    def output(result):
        if not _pair(result) or not (isinstance(query, mx.array) and query.ndim == 4
                                     and isinstance(context_lens, mx.array) and context_lens.ndim == 1):
            return result
        return _back(caps, pipeline, result, lambda out: out, lambda lse: lse, rows)

    kwargs = pipeline.kwargs()
    return NativeCall({**kwargs, **_kv_options(caps, kwargs)}, output,
                      (query, key_pages, value_pages, block_table, context_lens, page_size), pipeline.kv_dtype)


def native(caps, query, key_pages, value_pages, block_table, context_lens, page_size, **options) -> NativeCall:
    """The native call of a padded contract call (`options`: the contract's keywords)."""
    pipeline = ScorePipeline.of(options)
    if not caps.native_call:
        return _contract_form(caps, query, key_pages, value_pages, block_table, context_lens, page_size, pipeline)
    _well_formed(query, key_pages, value_pages, block_table, context_lens, page_size)
    L = query.shape[2]
    common = _common(caps, key_pages, value_pages, block_table, context_lens, page_size, pipeline, query.shape[-1])

    def rows():
        return conventions.Rows.padded(context_lens, L)

    if caps.query_packing == "padded":
        return NativeCall({"query": query, **common},
                          lambda result: _back(caps, pipeline, result, lambda out: out, lambda lse: lse, rows),
                          kv_dtype=pipeline.kv_dtype)
    packed = queries.pack(query, queries.query_lens(context_lens, L))
    cu = packed["cu_seqlens_q"]
    return NativeCall({**packed, **common}, lambda result: _back(
        caps, pipeline, result, lambda out: queries.unpack(out, cu, L), lambda lse: queries.unpack_lse(lse, cu, L),
        rows), kv_dtype=pipeline.kv_dtype)


def native_packed(caps, query, cu_seqlens_q, key_pages, value_pages, block_table, context_lens, page_size,
                  **options) -> NativeCall:
    """The native call of a batch of mixed query lengths: `query` `[T, Hq, Dk]` packed by
    `cu_seqlens_q`; the kernel's `[T, Hq, Dv]` (and lse `[T, Hq]`) come back packed."""
    if caps.query_packing != "varlen":
        raise NotExpressible("mixed query lengths in one batch need query_packing='varlen' "
                             "(the padded form gives every request the same L)")
    pipeline = ScorePipeline.of(options)
    lens = np.diff(np.array(cu_seqlens_q)).astype(np.int32)
    max_len = int(lens.max(initial=0))
    kwargs = {"query": query, "cu_seqlens_q": cu_seqlens_q, "max_seqlen_q": max_len,
              **_common(caps, key_pages, value_pages, block_table, context_lens, page_size, pipeline,
                        query.shape[-1])}
    return NativeCall(kwargs, lambda result: _back(caps, pipeline, result, lambda out: out, lambda lse: lse,
                                                   lambda: conventions.Rows.packed(cu_seqlens_q, context_lens)),
                      kv_dtype=pipeline.kv_dtype)
