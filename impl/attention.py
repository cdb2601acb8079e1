"""`paged_attention`: the operator contract of REFERENCE.md sections 1 and 1b on the CPU kernel.

| symbol         | meaning                                              | dtype / shape                  |
|----------------|------------------------------------------------------|--------------------------------|
| `query`        | the newest L positions of each request               | f32/f16/bf16 `[B, Hq, L, Dk]`  |
| `key_pages`    | the layer's key page pool                            | query's dtype (or codes) `[P, Hkv, ps, Dk]`|
| `value_pages`  | the layer's value page pool (Dv may differ from Dk)  | query's dtype (or codes) `[P, Hkv, ps, Dv]`|
| `block_table`  | request b, logical page i -> physical page           | int32 `[B, max_pages]`         |
| `context_lens` | valid positions of request b, the L new ones included| int32 `[B]`                    |
| `page_size`    | positions per page, equals `key_pages.shape[2]`      | int >= 1                       |
| `scale`        | score scale                                          | float, default `Dk ** -0.5`    |
| `mask`         | `"causal"` or None (all `context_lens[b]` keys seen) |                                |
| `window`       | causal only: a query sees its last `window` keys     | int >= 1 or None               |
| `softcap`      | `s = c * tanh(s / c)` on the scaled score            | float > 0 or None              |
| `alibi_slopes` | `s_j += slope_h * (j - p)` after the cap             | float32 `[Hq]` or None         |
| `sinks`        | a per-head logit in the softmax denominator only     | float32 `[Hq]` or None         |
| `return_lse`   | also return `lse = m + ln d` (natural log, sinks in) | bool                           |
| `kv_dtype`     | pages of 8-bit codes: `float8_e4m3fn`, `float8_e5m2` (uint8 bit patterns), `int8` | str or None |
| `k_scale`, `v_scale` | `x = decode(q) * s` per tensor, KV head or (token, KV head) (contract/kv_format.py) | float or float32 `[]`, `[Hkv]`, `[P, Hkv, ps]` |
| returns        | attention output (and lse: `-inf` for an empty slot) | query's dtype `[B, Hq, L, Dv]` (, float32 `[B, Hq, L]`) |

Query row l of request b sits at position `p = context_lens[b] - L + l`; query head h
reads KV head `h // (Hq // Hkv)`; a row with `context_lens[b] == 0` is an empty slot
(zeros, lse `-inf`). The options are one `ScorePipeline` (contract/pipeline.py) from
here on: validation and the kernel read that, not loose arguments.

The kernel is CPU-only: both entry points schedule it on the CPU stream whatever MLX's
default device is (on macOS the GPU), so a caller never reaches `eval_gpu`, which
raises. On Apple silicon the memory is unified, so this costs no copy.
"""

from __future__ import annotations

import mlx.core as mx
import pagecheck_kernels as _kernels

from .checked import checked_call, checked_contract_call, kernel_options
from .runtime import KERNEL_STREAM
from .validation import PagedMetadata, check_metadata_dtype, check_metadata_values


def _lazy(*args):
    """The kernel as a node of the caller's MLX graph, run with it on the CPU stream."""
    return _kernels.paged_attention(*args, stream=KERNEL_STREAM)


# The kernel run now in the calling thread; its outputs come back evaluated. Bound here,
# not wrapped in a function: each Python frame on the way is ~0.1 us of a small decode.
_now = _kernels.paged_attention_now


def _run(query, key_pages, value_pages, block_table, context_lens, page_size: int, args: tuple, return_lse: bool,
         entry=_lazy):
    """`entry` on the call's arrays and `args`, the kernel options (checked.kernel_options)."""
    out, lse = entry(query, key_pages, value_pages, block_table, context_lens, page_size, *args)
    # The kernel always writes the lse beside the output (the same merge makes both);
    # a caller that did not ask gets the output alone, as in the first contract.
    return (out, lse) if return_lse else out


def paged_attention(query, key_pages, value_pages, block_table, context_lens, page_size, *,
                    scale=None, mask="causal", window=None, softcap=None, alibi_slopes=None, sinks=None,
                    return_lse=False, kv_dtype=None, k_scale=None, v_scale=None):
    """Attention of each request's newest L positions over its paged K/V.

    Every argument is checked, metadata values included (one compiled pass over
    `block_table` and `context_lens` where they lie: no copy, ~1 us at B 1); on bad
    input `ContractViolation` is raised and nothing is computed. The checks that read no
    values (types, shapes, dtypes, options) give one verdict per signature, remembered
    when it passes (impl/checked.py: `checked_contract_call`); the metadata's dtypes and
    values are checked on every call. The kernel reads the
    very arrays checked: an MLX array is immutable (an in-place update rebinds the
    Python object to a new array; the graph keeps the checked one). Returns the output,
    or (output, lse) with `return_lse=True`.
    """
    options = (scale, mask, window, softcap, alibi_slopes, sinks, return_lse, kv_dtype, k_scale, v_scale)
    geom, opts = checked_contract_call(query, key_pages, value_pages, block_table, context_lens, page_size, options)
    # check_arrays took MLX arrays only: the kernel reads the caller's, checked in place
    table = check_metadata_dtype("block_table", block_table)
    lens = check_metadata_dtype("context_lens", context_lens)
    check_metadata_values(table, lens, page_size=geom.page_size, num_pages=geom.num_pages,
                          query_len=geom.query_len)
    return _run(query, key_pages, value_pages, table, lens, geom.page_size, kernel_options(opts, False),
                opts.return_lse)


def paged_attention_with_metadata(query, key_pages, value_pages, metadata: PagedMetadata, *,
                                  scale=None, mask="causal", window=None, softcap=None, alibi_slopes=None,
                                  sinks=None, return_lse=False, kv_dtype=None, k_scale=None, v_scale=None,
                                  kv_layout=None):
    """The serving path: metadata values were checked when `metadata` was built.

    Shapes and dtypes are still checked (no host sync), including that the call
    matches the batch, query length and pool the metadata was validated for.
    `kv_layout="amx_packed"`: the pools' page slices are in the tile-packed order
    (`PagePool(layout="amx_packed")`, conformance/formats/kv.py; bfloat16, page_size and
    head dim multiples of 32, Dv = Dk); None: the contract's rows. Returns a lazy
    output, a node of the caller's graph (`paged_attention_now` computes it at once).
    """
    options = (scale, mask, window, softcap, alibi_slopes, sinks, return_lse, kv_dtype, k_scale, v_scale, kv_layout)
    return _serving_call(query, key_pages, value_pages, metadata, options, _lazy)


def paged_attention_now(query, key_pages, value_pages, metadata: PagedMetadata, *,
                        scale=None, mask="causal", window=None, softcap=None, alibi_slopes=None, sinks=None,
                        return_lse=False, kv_dtype=None, k_scale=None, v_scale=None, kv_layout=None):
    """`paged_attention_with_metadata` computed now: the same arguments, checks and bits,
    returned evaluated.

    For a caller that evaluates each call anyway (a loop stepping op by op, as vLLM's
    CPU backend runs): the kernel runs in the calling thread (with the kernels' worker
    threads), so the output does not wait for a hand-off to MLX's stream thread and back,
    most of a small call (B 1, S 128: 38 -> 22 us past the checks). Inputs still being
    computed (a pending pool write, a lazy query) are evaluated first. Inside a model's
    graph, prefer the lazy entry: this one evaluates its inputs where it is called.
    """
    options = (scale, mask, window, softcap, alibi_slopes, sinks, return_lse, kv_dtype, k_scale, v_scale, kv_layout)
    return _serving_call(query, key_pages, value_pages, metadata, options, _now)


def _serving_call(query, key_pages, value_pages, metadata: PagedMetadata, options: tuple, entry):
    """options: the ScorePipeline's fields in order, then kv_layout; checked, or the
    checks remembered from an earlier call of the same signature (impl/checked.py)."""
    checked = checked_call(query, key_pages, value_pages, metadata, options)
    return _run(query, key_pages, value_pages, metadata.block_table, metadata.context_lens, metadata.page_size,
                checked.args, checked.opts.return_lse, entry)
