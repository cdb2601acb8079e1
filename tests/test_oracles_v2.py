"""Contract v2 in the oracles (REFERENCE.md 1b): soft-cap, ALiBi, sinks, LSE, Dk != Dv, merge.

* Every MLX oracle against the float64 one on each feature, each dtype and mask, under
  the tolerance rule (oracles/tolerance.py); MLX SDPA raises `NotApplicable` exactly
  where it cannot express the call (soft-cap, LSE, half-type sinks / ALiBi biases that
  do not round exactly to the query's dtype), and `oracles.compare` records the reason.
* The float64 oracle against small answers derived by hand, and `merge_states64`:
  tests/test_oracles_v2_by_hand.py (the calls both use: tests/v2_cases.py).
* The rule bites: outputs of the wrong pipeline (cap dropped, sink ignored, ALiBi
  offset from the last key, base-2 LSE, finite LSE on an empty row) fail `compare`.
"""

import math

import mlx.core as mx
import numpy as np
import pytest

import oracles
from fixtures import to_numpy
from oracles import NotApplicable
from oracles.compare import allowance, compare, reference
from oracles.tolerance import lse_error, max_abs_error
from tests.v2_cases import (DK, DV, EXACT_SINKS, L, ODD_SINKS, ODD_SLOPES, ORACLES, POW2_SLOPES, Hq, f32,
                            v2_case)

pytestmark = pytest.mark.correctness

# feature -> (options, value head dim, MLX SDPA can express it in half types)
FEATURES = {
    "softcap": (dict(softcap=1.5), DV, False),
    "alibi": (dict(alibi_slopes=POW2_SLOPES), DV, True),
    "alibi-odd": (dict(alibi_slopes=ODD_SLOPES), DV, False),
    "sinks": (dict(sinks=EXACT_SINKS), DV, True),
    "sinks-odd": (dict(sinks=ODD_SINKS), DV, False),
    "alibi+sinks": (dict(alibi_slopes=POW2_SLOPES, sinks=EXACT_SINKS), DV, True),  # ALiBi's offset shows
    "lse": (dict(return_lse=True), DK, False),
    "value_dim": (dict(), DV, True),
    "all": (dict(softcap=2.0, alibi_slopes=ODD_SLOPES, sinks=ODD_SINKS, return_lse=True), DV, False),
}
CLAUSE_OF = {"softcap": "softcap", "alibi": "alibi", "alibi-odd": "alibi", "sinks": "sinks", "sinks-odd": "sinks",
             "alibi+sinks": "alibi", "lse": "lse", "value_dim": "value_dim", "all": "lse"}
MASKS = {"causal": dict(mask="causal"), "unmasked": dict(mask=None), "window3": dict(mask="causal", window=3)}


def _sdpa_applicable(feature: str, dtype: str) -> bool:
    options, _, half_ok = FEATURES[feature]
    if "softcap" in options or options.get("return_lse"):
        return False
    return dtype == "float32" or half_ok


def _check_answer(got, case, who: str, dv: int):
    """(out, lse or None): shape, dtype, finite, zeros and -inf on empty rows."""
    out, lse = got if case.return_lse else (got, None)
    assert isinstance(out, mx.array) and out.dtype == case.dtype, f"{who}: output {type(out)} {getattr(out, 'dtype', '')}"
    B, _, Lq, _ = case.query.shape
    assert tuple(out.shape) == (B, Hq, Lq, dv), f"{who}: shape {out.shape}"
    host = to_numpy(out)
    empty = np.array(case.context_lens) == 0
    assert np.isfinite(host).all() and (host[empty] == 0).all(), f"{who}: non-finite, or an empty row not zeros"
    if lse is not None:
        assert lse.dtype == mx.float32 and tuple(lse.shape) == (B, Hq, Lq), f"{who}: lse {lse.dtype} {lse.shape}"
        lh = np.array(lse)
        assert np.isneginf(lh[empty]).all() and np.isfinite(lh[~empty]).all(), f"{who}: lse not -inf exactly on empty rows"
    return out, lse


# ---- each MLX oracle against the float64 one, feature by feature ---------------------------------

def _feature_params():
    for feature in FEATURES:
        for mask in MASKS:
            for dtype in ("float32", "float16", "bfloat16"):
                yield pytest.param(feature, mask, dtype, marks=pytest.mark.clause("oracle", CLAUSE_OF[feature]),
                                   id=f"{feature}-{mask}-{dtype}")


@pytest.mark.parametrize("oracle", ORACLES)
@pytest.mark.parametrize("feature,mask,dtype", list(_feature_params()))
def test_mlx_oracle_matches_float64_on_v2_feature(feature, mask, dtype, oracle):
    options, dv, _ = FEATURES[feature]
    case = v2_case({**options, **MASKS[mask]}, dtype=dtype, dv=dv)
    fn = oracles.MLX_ORACLES[oracle]
    if oracle == "sdpa" and not _sdpa_applicable(feature, dtype):
        with pytest.raises(NotApplicable) as raised:
            case.run(fn)
        assert raised.value.reason and isinstance(raised.value, Exception)
        return
    ref, allowed = reference(case.args(), case.kwargs())
    if oracle == "sdpa":  # its own error must not set the bar it is judged by: the a-priori bound E_na
        allowed = allowance(case.args(), ref, None, case.kwargs())
    out, lse = _check_answer(case.run(fn), case, f"oracle {oracle}", dv)
    if case.return_lse:
        (ref, ref_lse), (allowed, allowed_lse) = ref, allowed
        err = lse_error(lse, ref_lse)
        assert err <= allowed_lse, f"oracle {oracle} lse vs float64: {err:.3e} > allowed {allowed_lse:.3e}"
    err = max_abs_error(out, ref)
    assert err <= allowed, f"oracle {oracle} vs float64: {err:.3e} > allowed {allowed:.3e}"


@pytest.mark.clause("oracle")
@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compare_judges_v2_calls_and_records_what_sdpa_cannot(feature, dtype):
    options, dv, _ = FEATURES[feature]
    case = v2_case({**options, "window": 4}, dtype=dtype, dv=dv, seed=11)
    got = case.run(oracles.MLX_ORACLES["dense"])
    result = compare(got, case.args(), case.kwargs())
    assert not result.failures(), result.failures()
    if _sdpa_applicable(feature, dtype):
        assert "sdpa" in result.oracle_self and "sdpa" not in result.not_applicable
    elif case.return_lse and case.softcap is None and case.sinks is None:  # only the LSE is out of SDPA's reach
        assert "sdpa" in result.oracle_self and "LSE" in result.not_applicable["sdpa lse"]
    else:
        assert "sdpa" not in result.oracle_self and "sdpa" not in result.against_oracle
        assert result.not_applicable["sdpa"]
    if case.return_lse:
        assert result.lse_against_float64 is not None and set(result.lse_oracle_self) == {"equation", "dense"}
    else:
        assert result.lse_against_float64 is None and not result.lse_oracle_self


@pytest.mark.clause("oracle", "softcap")
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_large_logits_under_a_cap_stay_within_the_rule(dtype):
    """D = 64, scale 1: scores of ~+-60 through a cap of 20 (SDPA not applicable, the
    a-priori allowance): the float32 oracles meet it, and it still sits far below a bug's size."""
    case = v2_case(dict(scale=1.0, softcap=20.0, sinks=ODD_SINKS, alibi_slopes=POW2_SLOPES, return_lse=True),
                   dtype=dtype, head_dim=64, dv=32, lens=[40, 9], query_len=5, page_size=8)
    got = case.run(oracles.MLX_ORACLES["equation"])
    result = compare(got, case.args(), case.kwargs())
    assert not result.failures(), result.failures()
    assert result.against_float64.allowed < 0.01 * result.against_float64.scale
    uncapped = case.with_(softcap=None).run(oracles.MLX_ORACLES["equation"])
    assert any(f.startswith("vs float64") for f in compare(uncapped, case.args(), case.kwargs()).failures())


@pytest.mark.clause("value_dim", "empty_row")
@pytest.mark.parametrize("name", [*ORACLES, "float64"])
@pytest.mark.parametrize("lens", [[], [0, 0]], ids=["batch-0", "all-empty"])
def test_empty_batches_answer_in_the_value_head_dim(name, lens):
    fn = oracles.float64 if name == "float64" else oracles.MLX_ORACLES[name]
    case = v2_case(dict(sinks=EXACT_SINKS), lens=lens, query_len=2)
    out = case.run(fn)
    assert tuple(out.shape) == (len(lens), Hq, 2, DV) and not np.asarray(to_numpy(out) if name != "float64" else out).any()
    if name != "sdpa":
        _, lse = case.with_(return_lse=True).run(fn)
        assert tuple(lse.shape) == (len(lens), Hq, 2) and np.isneginf(np.asarray(lse)).all()


# ---- the SDPA oracle: what it can and cannot express ---------------------------------------------

def test_sdpa_is_not_applicable_to_softcap_or_lse_and_says_why():
    for options, word in ((dict(softcap=3.0), "soft-cap"), (dict(return_lse=True), "LSE")):
        with pytest.raises(NotApplicable, match=word):
            v2_case(options).run(oracles.sdpa.attention)
    with pytest.raises(NotApplicable, match="sinks not exactly representable"):
        v2_case(dict(sinks=ODD_SINKS), dtype="bfloat16").run(oracles.sdpa.attention)
    with pytest.raises(NotApplicable, match="ALiBi biases not exactly representable"):
        v2_case(dict(alibi_slopes=ODD_SLOPES), dtype="float16").run(oracles.sdpa.attention)
    assert issubclass(NotApplicable, Exception) and NotApplicable("why").reason == "why"


@pytest.mark.parametrize("name", [*ORACLES, "float64"])
def test_unknown_keyword_is_a_type_error(name):
    fn = oracles.float64 if name == "float64" else oracles.MLX_ORACLES[name]
    case = v2_case({})
    with pytest.raises(TypeError, match="softcapp"):
        fn(*case.args(), **case.kwargs(), softcapp=2.0)


@pytest.mark.parametrize("name", [*ORACLES, "float64"])
def test_the_lse_is_returned_only_when_asked(name):
    fn = oracles.float64 if name == "float64" else oracles.MLX_ORACLES[name]
    case = v2_case(dict(sinks=EXACT_SINKS))
    out = case.run(fn)
    assert not isinstance(out, tuple) and tuple(out.shape) == (3, Hq, L, DV)
    if name != "sdpa":
        pair = case.with_(return_lse=True).run(fn)
        assert isinstance(pair, tuple) and len(pair) == 2 and tuple(pair[1].shape) == (3, Hq, L)


def test_float64_oracle_reads_slopes_and_sinks_from_numpy_mlx_or_lists():
    case = v2_case(dict(mask=None))
    answers = [oracles.float64(*case.args(), **case.kwargs(), alibi_slopes=s, sinks=k, return_lse=True)
               for s, k in ((POW2_SLOPES, ODD_SINKS), (np.array(POW2_SLOPES, np.float32), np.array(ODD_SINKS, np.float32)),
                            (f32(POW2_SLOPES), f32(ODD_SINKS)), (f32(POW2_SLOPES).astype(mx.bfloat16), f32(ODD_SINKS)))]
    # lists hold the float64 values, the rest float32 ones; bfloat16 holds the same powers of two
    for out, lse in answers[2:]:
        assert np.array_equal(out, answers[1][0]) and np.array_equal(lse, answers[1][1])
    assert np.allclose(answers[0][0], answers[1][0], rtol=0, atol=1e-6)


# ---- the rule bites: wrong pipelines fail compare ------------------------------------------------

def _wrong(case, **changes):
    """The output of the equation oracle on a changed call, judged as the answer to `case`."""
    return compare(case.with_(**changes).run(oracles.MLX_ORACLES["equation"]), case.args(), case.kwargs())


@pytest.mark.clause("oracle", "softcap", "sinks", "alibi", "lse")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_wrong_pipelines_fail_compare(dtype):
    case = v2_case(dict(softcap=1.0, sinks=EXACT_SINKS, alibi_slopes=POW2_SLOPES, return_lse=True, scale=1.0),
                   dtype=dtype, lens=[13, 0, 9], seed=17)
    assert not _wrong(case).failures()
    assert any(f.startswith("vs float64") for f in _wrong(case, softcap=None).failures()), "cap dropped"
    assert any(f.startswith("vs float64") for f in _wrong(case, sinks=None).failures()), "sink ignored"
    assert any(f.startswith("vs float64") for f in _wrong(case, sinks=case.sinks * 2).failures()), "sink twice"
    assert any(f.startswith("lse vs float64") for f in _wrong(case, alibi_slopes=None).failures()), "no ALiBi"
    assert any(f.startswith("lse vs float64") for f in _wrong(case, scale=0.5).failures()), "scale"
    out, lse = case.run(oracles.MLX_ORACLES["equation"])
    for bad in (lse / math.log(2), lse + 0.05, mx.where(mx.isinf(lse), 0.0, lse), lse * mx.nan):
        failures = compare((out, bad), case.args(), case.kwargs()).failures()
        assert any(f.startswith("lse vs float64") for f in failures), failures
    with pytest.raises(TypeError, match=r"returns \(out, lse\)"):
        compare(out, case.args(), case.kwargs())
    with pytest.raises(TypeError, match="out alone"):
        compare((out, lse), case.args(), case.with_(return_lse=False).kwargs())


def _row_with_offset_from_last_key(case, l):
    """Row l of `case` as a kernel biasing slope * (j - (ctx - 1)) computes it: every key's
    bias lower by slope * (L - 1 - l) than slope * (j - p), which the softmax sees as the
    sink raised by that much."""
    raised = case.sinks + case.alibi_slopes * (case.query.shape[2] - 1 - l)
    return case.with_(sinks=raised).run(oracles.MLX_ORACLES["equation"])[:, :, l:l + 1]


@pytest.mark.clause("alibi", "sinks")
def test_alibi_offset_from_the_last_key_fails_with_a_sink():
    """The offset convention slope * (j - (ctx - 1)) instead of the row's own position p:
    invisible without a sink (the softmax cancels a constant), caught with one."""
    case = v2_case(dict(sinks=EXACT_SINKS, alibi_slopes=POW2_SLOPES), lens=[13, 9], query_len=5, seed=19)
    bad = mx.concatenate([_row_with_offset_from_last_key(case, l) for l in range(5)], axis=2)
    result = compare(bad, case.args(), case.kwargs())
    assert max_abs_error(bad, case.run(oracles.float64)) > 10 * result.against_float64.allowed
    assert any(f.startswith("vs float64") for f in result.failures())
    same = case.with_(sinks=None)  # without a sink the same offset changes nothing beyond rounding
    assert not compare(mx.concatenate([_row_with_offset_from_last_key(case.with_(sinks=mx.full((Hq,), -mx.inf)), l)
                                       for l in range(5)], axis=2), same.args(), same.kwargs()).failures()
