"""Batches of mixed query lengths in one packed call (fixtures/mixed.py): decode rows beside
prefill chunks, speculative rows of 3, empty slots, windows and unmasked rows.

Only a kernel with packed queries (`query_packing="varlen"`) can be asked this; for the
padded form each check is a skip with the reason. Each request's rows of the packed
output must match the four oracles on that request alone (the tolerance rule), and the
output must keep the query's dtype and one row per packed query row.
"""

import pytest

from fixtures.mixed import mixed_case
from oracles.compare import compare

pytestmark = pytest.mark.correctness

# name -> mixed_case arguments; page size 16 and D 64 keep block-multiple kernels in
MIXED = {
    "decode-beside-prefill": dict(context_lens=[37, 20, 9], query_lens=[1, 12, 9]),
    "prefill-beside-decodes": dict(context_lens=[5, 70, 33, 1], query_lens=[1, 40, 1, 1]),
    "speculative-3-beside-decode": dict(context_lens=[50, 18, 64], query_lens=[3, 1, 3]),
    "empty-slots-between": dict(context_lens=[0, 15, 0, 40], query_lens=[0, 3, 0, 1]),
    "windowed": dict(context_lens=[60, 33, 17], query_lens=[1, 17, 2], window=8),
    "unmasked": dict(context_lens=[21, 48], query_lens=[2, 5], mask=None),
    "whole-context-as-query": dict(context_lens=[16, 3, 32], query_lens=[16, 1, 32]),
}
DTYPES = ("float32", "float16", "bfloat16")


@pytest.mark.clause("oracle", "causal")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(MIXED))
def test_mixed_lengths_match_each_request_alone(name, dtype, attention, error_log):
    mixed = mixed_case(q_heads=4, kv_heads=2, head_dim=64, page_size=16, dtype=dtype, seed=sorted(MIXED).index(name),
                       name=name, **MIXED[name])
    out = attention.packed(mixed)
    assert out.dtype == mixed.query.dtype, f"output {out.dtype}, expected the query's {mixed.query.dtype}"
    assert out.shape == mixed.query.shape, f"output {out.shape}, expected one row per packed query {mixed.query.shape}"
    for b in range(len(mixed.query_lens)):
        alone = mixed.request(b)
        if alone is None:
            continue
        result = compare(mixed.rows(out, b), alone.args(), alone.kwargs())
        error_log.record(alone.dtype, "float64", result.against_float64)
        assert not result.failures(), f"request {b} (query length {mixed.query_lens[b]}): {result.failures()}"
