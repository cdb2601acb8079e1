"""The implementation under test against all four oracles under the tolerance rule.

The grid covers page sizes {1, 3, 16, 128}, GQA ratios {1, 4, 8}, D {64, 128}, L {1, 5, 8,
9, 65}, three dtypes, causal / unmasked / windowed, random non-consecutive page ids with
free pages between them, NaN in every unused slot and free page, and an empty row.
Page size x L is crossed in full; the other axes rotate through it (each value meets
every page size and every L), which keeps the suite inside its time budget.
"""

import itertools

import pytest

from fixtures import paged_case
from oracles.compare import compare

pytestmark = pytest.mark.correctness

PAGE_SIZES = (1, 3, 16, 128)
QUERY_LENS = (1, 5, 8, 9, 65)
GQA = ((4, 4), (8, 2), (8, 1))  # (Hq, Hkv): ratios 1, 4, 8
HEAD_DIMS = (64, 128)
MASKS = (("causal", None), (None, None), ("causal", 7), ("causal", 1))
DTYPES = ("float32", "float16", "bfloat16")


def _grid():
    for i, (ps, L) in enumerate(itertools.product(PAGE_SIZES, QUERY_LENS)):
        for k, dtype in enumerate(DTYPES):
            n = 3 * i + k
            (hq, hkv), D, (mask, window) = GQA[n % 3], HEAD_DIMS[n // 3 % 2], MASKS[n % 4]
            yield pytest.param(ps, L, hq, hkv, D, dtype, mask, window,
                               id=f"ps{ps}-L{L}-{hq}:{hkv}-D{D}-{dtype}-{mask}-w{window}")


@pytest.mark.clause("oracle")
@pytest.mark.parametrize("ps,L,hq,hkv,D,dtype,mask,window", list(_grid()))
def test_matches_oracles(ps, L, hq, hkv, D, dtype, mask, window, attention, error_log):
    # contexts: one just past L, one empty slot, one crossing several pages and a chunk
    contexts = [L + 3, 0, L + 2 * ps + 5 if ps < 128 else L + 300]
    case = paged_case(context_lens=contexts, query_len=L, q_heads=hq, kv_heads=hkv, head_dim=D,
                      page_size=ps, dtype=dtype, mask=mask, window=window, seed=ps * 100 + L)
    out = case.run(attention)
    assert out.dtype == case.dtype and out.shape == case.query.shape, (
        f"output {out.dtype} {out.shape}, expected {case.dtype} {case.query.shape}")
    result = compare(out, case.args(), case.kwargs())
    error_log.record(case.dtype, "float64", result.against_float64)
    for name, verdict in result.against_oracle.items():
        error_log.record(case.dtype, name, verdict)
    assert not result.failures(), result.failures()
