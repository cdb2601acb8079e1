"""The built-in kernel on tile-packed pools (`kv_layout="amx_packed"`), as an `--impl` plug-in.

    ./pagecheck report --impl impl.packed:paged_attention_amx_packed

runs the conformance catalog on the serving path's packed pages: every call's pools go
through the converter of conformance/formats/kv.py into the amx_packed order, then through
`paged_attention_with_metadata(..., kv_layout="amx_packed")`, and the output is judged by
the oracles on the row pools. Its declaration is the built-in's narrowed to what the
layout holds: bfloat16 pages, page sizes and head dims multiples of 32, Dv = Dk, no
quantized pages.
"""

from __future__ import annotations

from .attention import paged_attention_with_metadata
from .errors import ContractViolation
from .runtime import set_num_threads
from .validation import PagedMetadata, check_metadata_dtype


def paged_attention_amx_packed(*, query, key_cache, value_cache, block_table, seq_lens, page_size, scale, causal,
                               window=None, softcap=None, alibi_slopes=None, sinks=None, return_lse=False):
    """The layout's native call (conformance/formats: `key_cache`, `value_cache` packed,
    the padded table, `window` a key count). Metadata values are checked as
    `impl.paged_attention` checks them (`PagedMetadata.build`), so bad input raises the
    same `ContractViolation`."""
    table = check_metadata_dtype("block_table", block_table)
    lens = check_metadata_dtype("context_lens", seq_lens)
    num_pages = key_cache.shape[0] if getattr(key_cache, "ndim", 0) == 4 else 0
    query_len = query.shape[2] if getattr(query, "ndim", 0) == 4 else 0
    meta = PagedMetadata.build(table, lens, page_size=page_size, num_pages=num_pages, query_len=query_len)
    return paged_attention_with_metadata(query, key_cache, value_cache, meta, scale=scale,
                                         mask="causal" if causal else None, window=window, softcap=softcap,
                                         alibi_slopes=alibi_slopes, sinks=sinks, return_lse=return_lse,
                                         kv_layout="amx_packed")


paged_attention_amx_packed.pagecheck_capabilities = dict(
    layout="amx_packed", dtypes=["bfloat16"], block_multiple=32, head_dims=[32, 64, 96, 128],
    bitwise_batch=True, bitwise_threads=True, set_num_threads=set_num_threads, error_types=(ContractViolation,),
    extra_memory=1.0, softcap=True, alibi=True, sinks=True, lse=True)
