"""Operator latency, side by side in one run (`pytest --benchmark-only`).

Paths on identical inputs (decode: B=4, Hq=32, Hkv=8, D=128, page size 16):
`paged` (ours, metadata validated once as in serving), `dense_gather` (gather through
the table, then dense attention; the gather is counted), `mlx_sdpa` (MLX's fused SDPA on
K/V gathered beforehand). Compare medians within one run only: the machine is shared.
The full grid, bandwidth fractions and peers come with the benchmark issue.
"""

import mlx.core as mx
import pytest

import impl
import oracles
from fixtures import paged_case
from oracles.dense import dense_gather

SHAPE = dict(q_heads=32, kv_heads=8, head_dim=128, page_size=16, fill=0.0, extra_pages=0)


def _decode_case(context, dtype):
    return paged_case(context_lens=[context] * 4, query_len=1, dtype=dtype, seed=context, **SHAPE)


def _paged(case):
    meta = impl.PagedMetadata.build(case.block_table, case.context_lens, page_size=case.page_size,
                                    num_pages=case.key_pages.shape[0], query_len=case.query.shape[2])
    return lambda: mx.eval(impl.paged_attention_with_metadata(case.query, case.key_pages, case.value_pages,
                                                              meta, mask=case.mask))


def _dense_gather(case):
    return lambda: mx.eval(case.run(oracles.dense.attention))


def _mlx_sdpa(case):
    """Every request holds the same context, so MLX's own "causal" (aligned at the last
    key) is the contract's causal mask; a one-token decode needs no mask at all."""
    keys, values, _ = dense_gather(case.key_pages, case.value_pages, case.block_table, case.context_lens,
                                   case.page_size)
    mx.eval(keys, values)
    mask = "causal" if case.query.shape[2] > 1 else None
    return lambda: mx.eval(mx.fast.scaled_dot_product_attention(case.query, keys, values,
                                                                scale=case.query.shape[-1] ** -0.5, mask=mask))


PATHS = {"paged": _paged, "dense_gather": _dense_gather, "mlx_sdpa": _mlx_sdpa}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("context", [128, 1024])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_decode(benchmark, path, context, dtype):
    case = _decode_case(context, dtype)
    benchmark.group = f"decode S={context} {dtype}"
    benchmark.extra_info.update(path=path, context=context, dtype=dtype, batch=4)
    benchmark(PATHS[path](case))


@pytest.mark.parametrize("path", ["paged", "mlx_sdpa"])
def test_prefill(benchmark, path):
    case = paged_case(context_lens=[256], query_len=256, dtype="float32", seed=1, **SHAPE)
    benchmark.group = "prefill L=S=256 float32"
    benchmark.pedantic(PATHS[path](case), rounds=3, iterations=1, warmup_rounds=1)

