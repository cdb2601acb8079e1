"""The built-in kernel computed now (`impl.paged_attention_now`), as an `--impl` plug-in.

    ./pagecheck report --impl impl.now:paged_attention

runs the conformance catalog on the eager entry point: each call is checked as
`impl.paged_attention` checks it (shapes and dtypes, then the metadata's values, through
`PagedMetadata.build`), then computed at once in the calling thread and returned
evaluated. Its declaration is the built-in's whole one: every dtype, contract v2 feature
and KV format, bitwise across batches and worker counts. The catalog then holds the
eager entry to the same answers, errors and bit invariants as the lazy one.
"""

from __future__ import annotations

from contract import GRANULARITIES, KV_DTYPES, ScorePipeline

from .attention import paged_attention_now
from .errors import ContractViolation
from .runtime import set_num_threads
from .validation import PagedMetadata, check_arrays


def paged_attention(query, key_pages, value_pages, block_table, context_lens, page_size, **options):
    """The contract's call (impl.paged_attention's arguments), computed now."""
    pipeline = ScorePipeline.of(options)
    geom = check_arrays(query, key_pages, value_pages, block_table, context_lens, page_size, pipeline.kv_dtype)
    meta = PagedMetadata.build(block_table, context_lens, page_size=geom.page_size, num_pages=geom.num_pages,
                               query_len=geom.query_len)
    return paged_attention_now(query, key_pages, value_pages, meta, **options)


paged_attention.pagecheck_capabilities = dict(
    bitwise_batch=True, bitwise_threads=True, set_num_threads=set_num_threads, error_types=(ContractViolation,),
    extra_memory=0.0, softcap=True, alibi=True, sinks=True, lse=True, value_head_dim=True,
    kv_dtypes=sorted(KV_DTYPES), kv_scales=sorted(GRANULARITIES))
