"""Valid edge inputs through the implementation under test and through every oracle.

The contract accepts a pool of 0 pages when no row reads one, a batch whose rows are
all empty, a table with more columns than the pool has pages (the unread entries -1 or
garbage) and a batch of 0 requests (impl/validation.py rejects none of them, and the
built-in answers each). An oracle that cannot answer such a call cannot judge an
implementation on it, so each case (fixtures/edge_cases.py) runs through the
implementation and through each oracle in turn (equation, dense, sdpa, float64, and
`oracles.compare` over all four), one test each:

* every output has the query's shape (and, from MLX, its dtype), is finite, and is
  exactly zero on every empty row (B = 0: an empty `[0, Hq, L, D]`);
* each MLX oracle is within the tolerance rule of the float64 oracle, and the
  implementation's output within the rule plus that oracle's own error of it, exactly as
  `oracles.compare` judges (which must itself run and find nothing).

The same cases with contract-v2 options (sinks, ALiBi, soft-cap, LSE) run through each
oracle alone (the implementation's v2 catalog is elsewhere): each answers, an empty row
gives zeros and LSE -inf with its sink ignored, and MLX SDPA either answers within the
rule or says `NotApplicable` (soft-cap, LSE).
"""

import mlx.core as mx
import numpy as np
import pytest

import oracles
from fixtures import edge_case, edge_names, to_numpy
from oracles import NotApplicable
from oracles.compare import compare, reference
from oracles.tolerance import lse_error, max_abs_error

pytestmark = pytest.mark.correctness

ORACLES = {**oracles.MLX_ORACLES, "float64": oracles.float64}


def _assert_answers(out, case, who: str) -> np.ndarray:
    """Shape, dtype, finite, zeros on empty rows; returns the host copy."""
    host = to_numpy(out) if isinstance(out, mx.array) else np.asarray(out)
    assert host.shape == tuple(case.query.shape), f"{who}: shape {host.shape}, query {tuple(case.query.shape)}"
    if isinstance(out, mx.array):
        assert out.dtype == case.dtype, f"{who}: dtype {out.dtype}, query {case.dtype}"
    assert np.isfinite(host).all(), f"{who}: non-finite output on a valid call"
    empty = np.array(case.context_lens) == 0
    assert (host[empty] == 0).all(), f"{who}: an empty row (context 0) is not zeros"
    return host


def test_the_edge_catalog_sits_on_its_edges():
    """Guards the cases below: each has the shape its name promises."""
    shapes = {n: (edge_case(n).key_pages.shape[0], *edge_case(n).block_table.shape) for n in edge_names()}
    assert shapes["pool-0-pages"][0] == 0 and shapes["pool-0-pages-table-0-columns"] == (0, 3, 0)
    assert shapes["batch-0"][:2] == (3, 0) and shapes["batch-0-pool-0-pages"] == (0, 0, 0)
    for name in ("table-wider-than-pool", "table-wider-than-pool-garbage", "table-wider-than-pool-prefill"):
        P, _, max_pages = shapes[name]
        assert max_pages > P, name
    table = np.array(edge_case("table-wider-than-pool-garbage").block_table)
    assert (table >= shapes["table-wider-than-pool-garbage"][0]).any() and (table < -1).any()
    for name in ("all-rows-empty-decode", "all-rows-empty-prefill"):
        case = edge_case(name)
        assert case.key_pages.shape[0] > 0 and not np.array(case.context_lens).any()
        assert np.isnan(to_numpy(case.key_pages)).all()  # nothing to read but NaN


@pytest.mark.clause("empty_row", "inv9", "oracle")
@pytest.mark.parametrize("oracle", [*ORACLES, "compare"])
@pytest.mark.parametrize("name", edge_names())
def test_valid_edge_input_runs_through_the_oracle(name, oracle, attention, error_log):
    case = edge_case(name)
    out = case.run(attention)
    _assert_answers(out, case, attention.name)
    if oracle == "compare":
        result = compare(out, case.args(), case.kwargs())
        error_log.record(case.dtype, "float64", result.against_float64)
        assert not result.failures(), result.failures()
        return
    got = _assert_answers(case.run(ORACLES[oracle]), case, f"oracle {oracle}")
    ref, allowed = reference(case.args(), case.kwargs())
    own = max_abs_error(got, ref)
    assert own <= allowed, f"oracle {oracle} vs float64: {own:.3e} > allowed {allowed:.3e}"
    err = max_abs_error(out, got)
    assert err <= allowed + own, f"{attention.name} vs oracle {oracle}: {err:.3e} > {allowed + own:.3e}"


# contract-v2 options for the edge cases (Hq = 4): sinks and slopes exact in every dtype
V2_OPTIONS = {
    "sinks-alibi": dict(sinks=[0.5, -1.0, 2.0, 0.25], alibi_slopes=[0.5, 0.25, 0.125, 0.0625]),
    "softcap-sinks-lse": dict(softcap=1.5, sinks=[0.5, -1.0, 2.0, 0.25], return_lse=True),
}


def _v2(case, options: str):
    return case.with_(**{k: mx.array(np.array(v, dtype=np.float32)) if isinstance(v, list) else v
                         for k, v in V2_OPTIONS[options].items()})


@pytest.mark.clause("empty_row", "inv9", "oracle", "sinks", "lse")
@pytest.mark.parametrize("oracle", [*ORACLES, "compare"])
@pytest.mark.parametrize("options", list(V2_OPTIONS))
@pytest.mark.parametrize("name", edge_names())
def test_valid_edge_input_with_v2_options_runs_through_the_oracle(name, options, oracle):
    case = _v2(edge_case(name), options)
    if oracle == "compare":  # the equation oracle's answer, judged by all four
        result = compare(case.run(oracles.MLX_ORACLES["equation"]), case.args(), case.kwargs())
        assert not result.failures(), result.failures()
        assert ("sdpa" in result.not_applicable) == (case.softcap is not None)
        return
    if oracle == "sdpa" and (case.softcap is not None or case.return_lse):
        with pytest.raises(NotApplicable):
            case.run(ORACLES[oracle])
        return
    got = case.run(ORACLES[oracle])
    ref, allowed = reference(case.args(), case.kwargs())
    (ref, ref_lse), (allowed, allowed_lse) = (ref, allowed) if case.return_lse else ((ref, None), (allowed, None))
    out, lse = got if case.return_lse else (got, None)
    host = _assert_answers(out, case, f"oracle {oracle}")
    own = max_abs_error(host, ref)
    assert own <= allowed, f"oracle {oracle} vs float64: {own:.3e} > allowed {allowed:.3e}"
    if lse is not None:
        lse = np.asarray(lse, dtype=np.float64)
        assert lse.shape == tuple(case.query.shape[:3]), f"oracle {oracle}: lse shape {lse.shape}"
        empty = np.array(case.context_lens) == 0
        assert np.isneginf(lse[empty]).all() and np.isfinite(lse[~empty]).all(), f"oracle {oracle}: lse on empty rows"
        err = lse_error(lse, ref_lse)
        assert err <= allowed_lse, f"oracle {oracle} lse vs float64: {err:.3e} > allowed {allowed_lse:.3e}"
