"""`paged_attention`: the operator contract of REFERENCE.md section 1 on the CPU kernel.

| symbol         | meaning                                              | dtype / shape                  |
|----------------|------------------------------------------------------|--------------------------------|
| `query`        | the newest L positions of each request               | f32/f16/bf16 `[B, Hq, L, D]`   |
| `key_pages`    | the layer's key page pool                            | query's dtype `[P, Hkv, ps, D]`|
| `value_pages`  | the layer's value page pool                          | query's dtype `[P, Hkv, ps, D]`|
| `block_table`  | request b, logical page i -> physical page           | int32 `[B, max_pages]`         |
| `context_lens` | valid positions of request b, the L new ones included| int32 `[B]`                    |
| `page_size`    | positions per page, equals `key_pages.shape[2]`      | int >= 1                       |
| `scale`        | score scale                                          | float, default `D ** -0.5`     |
| `mask`         | `"causal"` or None (all `context_lens[b]` keys seen) |                                |
| `window`       | causal only: a query sees its last `window` keys     | int >= 1 or None               |
| returns        | attention output                                     | query's dtype `[B, Hq, L, D]`  |

Query row l of request b sits at position `context_lens[b] - L + l`; query head h reads
KV head `h // (Hq // Hkv)`; a row with `context_lens[b] == 0` is an empty slot (zeros).

The kernel is CPU-only: both entry points schedule it on the CPU stream whatever MLX's
default device is (on macOS the GPU), so a caller never reaches `eval_gpu`, which
raises. On Apple silicon the memory is unified, so this costs no copy.
"""

from __future__ import annotations

import mlx.core as mx
import pagecheck_kernels as _kernels

from .runtime import KERNEL_STREAM
from .validation import PagedMetadata, check_arrays, check_options


def paged_attention(query, key_pages, value_pages, block_table, context_lens, page_size, *,
                    scale=None, mask="causal", window=None) -> mx.array:
    """Attention of each request's newest L positions over its paged K/V.

    Every argument is checked, metadata values included (one host read of
    `block_table` and `context_lens`); on bad input `ContractViolation` is raised and
    nothing is computed.
    """
    geom = check_arrays(query, key_pages, value_pages, block_table, context_lens, page_size)
    scale, causal, window = check_options(geom.head_dim, scale, mask, window)
    meta = PagedMetadata.build(block_table, context_lens, page_size=geom.page_size,
                               num_pages=geom.num_pages, query_len=geom.query_len)
    return _kernels.paged_attention(query, key_pages, value_pages, meta.block_table, meta.context_lens,
                                    geom.page_size, scale, causal, window, stream=KERNEL_STREAM)


def paged_attention_with_metadata(query, key_pages, value_pages, metadata: PagedMetadata, *,
                                  scale=None, mask="causal", window=None) -> mx.array:
    """The serving path: metadata values were checked when `metadata` was built.

    Shapes and dtypes are still checked (no host sync), including that the call
    matches the batch, query length and pool the metadata was validated for.
    """
    geom = check_arrays(query, key_pages, value_pages, metadata.block_table, metadata.context_lens,
                        metadata.page_size)
    scale, causal, window = check_options(geom.head_dim, scale, mask, window)
    metadata.check_matches(geom)
    return _kernels.paged_attention(query, key_pages, value_pages, metadata.block_table,
                                    metadata.context_lens, geom.page_size, scale, causal, window,
                                    stream=KERNEL_STREAM)
