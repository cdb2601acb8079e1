"""Contract v2 in the oracles (REFERENCE.md 1b): soft-cap, ALiBi, sinks, LSE, Dk != Dv, merge.

* Every MLX oracle against the float64 one on each feature, each dtype and mask, under
  the tolerance rule (oracles/tolerance.py); MLX SDPA raises `NotApplicable` exactly
  where it cannot express the call (soft-cap, LSE, half-type sinks / ALiBi biases that
  do not round exactly to the query's dtype), and `oracles.compare` records the reason.
* The float64 oracle against small answers derived by hand here: a saturated cap at
  |s/c| = 1e4, a sink beside one visible key, ALiBi at the first and last visible key
  (prefill rows, unmasked rows seeing keys after p), the LSE of an empty row,
  `merge_states64` of empty states, and a cascade (prefix unmasked + suffix causal,
  merged) equal to one call.
* The rule bites: outputs of the wrong pipeline (cap dropped, sink ignored, ALiBi
  offset from the last key, base-2 LSE, finite LSE on an empty row) fail `compare`.
"""

import math

import mlx.core as mx
import numpy as np
import pytest

import oracles
from fixtures import paged_case, to_numpy
from oracles import NotApplicable, merge_states64
from oracles.compare import allowance, compare, reference
from oracles.tolerance import lse_error, max_abs_error

pytestmark = pytest.mark.correctness

ORACLES = sorted(oracles.MLX_ORACLES)
Hq, Hkv, DK, DV = 4, 2, 8, 6
LENS, L = [13, 0, 6], 3


def _f32(values) -> mx.array:
    return mx.array(np.array(values, dtype=np.float32))


POW2_SLOPES = [2.0 ** -(h + 1) for h in range(Hq)]  # ALiBi's own slopes: exact in every dtype
ODD_SLOPES = [0.3, 0.17, 0.071, 0.0123]  # not exact in float16 / bfloat16
EXACT_SINKS = [0.5, -1.0, 2.0, 0.25]
ODD_SINKS = [0.3, -1.3, 2.7, 0.01]

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


def v2_case(options: dict, *, dtype="float32", dv=DV, lens=LENS, query_len=L, head_dim=DK, page_size=4,
            seed=5, **layout):
    """A paged layout (fixtures/layouts.py) with value pages of head dim `dv`: the value
    pool of the same layout (same seed: same table, same NaN slots) drawn at dv."""
    case = paged_case(context_lens=lens, query_len=query_len, q_heads=Hq, kv_heads=Hkv, head_dim=head_dim,
                      page_size=page_size, dtype=dtype, seed=seed, **layout)
    if dv != head_dim:
        other = paged_case(context_lens=lens, query_len=query_len, q_heads=Hq, kv_heads=Hkv, head_dim=dv,
                           page_size=page_size, dtype=dtype, seed=seed, **layout)
        assert np.array_equal(np.array(other.block_table), np.array(case.block_table))
        case = case.with_(value_pages=other.value_pages)
    opts = {k: (_f32(v) if k in ("alibi_slopes", "sinks") else v) for k, v in options.items()}
    return case.with_(**opts)


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
                            (_f32(POW2_SLOPES), _f32(ODD_SINKS)), (_f32(POW2_SLOPES).astype(mx.bfloat16), _f32(ODD_SINKS)))]
    # lists hold the float64 values, the rest float32 ones; bfloat16 holds the same powers of two
    for out, lse in answers[2:]:
        assert np.array_equal(out, answers[1][0]) and np.array_equal(lse, answers[1][1])
    assert np.allclose(answers[0][0], answers[1][0], rtol=0, atol=1e-6)


# ---- the float64 oracle against answers derived by hand ------------------------------------------

def hand_call(keys, values, query, *, page_size=2, lens=None, **options):
    """One request (or more) with exactly these keys / values / queries, written through a
    random layout's block table (fixtures/layouts.py: NaN elsewhere). keys [Hkv][ctx][Dk],
    values [Hkv][ctx][Dv], query [B][Hq][L][Dk] (every request the same K/V prefix, of its
    own length `lens[b]`, ctx = len(keys[0]) by default)."""
    keys, values, query = (np.array(x, dtype=np.float64) for x in (keys, values, query))
    hkv, ctx, dk = keys.shape
    B, hq, Lq, _ = query.shape
    lens = [ctx] * B if lens is None else lens
    k_case = paged_case(context_lens=lens, query_len=Lq, q_heads=hq, kv_heads=hkv, head_dim=dk,
                        page_size=page_size, seed=7)
    v_case = paged_case(context_lens=lens, query_len=Lq, q_heads=hq, kv_heads=hkv, head_dim=values.shape[-1],
                        page_size=page_size, seed=7)
    table = np.array(k_case.block_table)
    kp, vp = np.array(k_case.key_pages), np.array(v_case.value_pages)
    for b, n in enumerate(lens):
        for j in range(n):
            kp[table[b, j // page_size], :, j % page_size] = keys[:, j]
            vp[table[b, j // page_size], :, j % page_size] = values[:, j]
    opts = {k: (_f32(v) if k in ("alibi_slopes", "sinks") else v) for k, v in options.items()}
    return k_case.with_(query=mx.array(query.astype(np.float32)), key_pages=mx.array(kp), value_pages=mx.array(vp),
                        **opts)


@pytest.mark.clause("softcap")
def test_softcap_saturated_at_1e4_gives_plus_minus_c_exactly():
    """s = +-1e4, c = 1: tanh(1e4) = 1, the capped scores are exactly +-1 (an exp-based tanh
    gives inf / inf there). Unit value rows read the weights: sigmoid(+-2); lse = logaddexp(1, -1)."""
    case = hand_call(keys=[[[1e4], [-1e4]]], values=[[[1.0, 0.0], [0.0, 1.0]]], query=[[[[1.0]]]],
                     scale=1.0, softcap=1.0, return_lse=True)
    out, lse = case.run(oracles.float64)
    sig = 1 / (1 + math.exp(-2.0))
    np.testing.assert_allclose(out[0, 0, 0], [sig, 1 - sig], rtol=0, atol=1e-15)
    assert abs(lse[0, 0, 0] - np.logaddexp(1.0, -1.0)) <= 1e-15
    for name in ("equation", "dense"):  # the float32 oracles land on the same saturated scores
        got, got_lse = case.run(oracles.MLX_ORACLES[name])
        np.testing.assert_allclose(np.array(got)[0, 0, 0], [sig, 1 - sig], rtol=0, atol=2e-7)
        assert np.isfinite(np.array(got_lse)).all() and abs(float(got_lse[0, 0, 0]) - np.logaddexp(1, -1)) <= 4e-7


@pytest.mark.clause("softcap")
def test_softcap_applies_to_the_scaled_score():
    """q . k = 4, scale 0.5, c = 1: the capped score is tanh(2) (not 0.5 * tanh(4)), against a
    second key of score 0: weights e^tanh(2) : 1."""
    case = hand_call(keys=[[[2.0, 0.0], [0.0, 0.0]]], values=[[[1.0], [0.0]]], query=[[[[2.0, 5.0]]]],
                     scale=0.5, softcap=1.0)
    out = case.run(oracles.float64)
    e = math.exp(math.tanh(2.0))
    assert abs(out[0, 0, 0, 0] - e / (e + 1)) <= 1e-15


@pytest.mark.clause("sinks", "lse")
def test_sink_beside_one_visible_key():
    """Position 0 sees key 0 only: s = q . k = 1; sigma = 3: o = v / (1 + e^(sigma - s)),
    lse = logaddexp(s, sigma). The second request is an empty slot: zeros, lse -inf, its
    sink ignored."""
    case = hand_call(keys=[[[0.5, 0.25]]], values=[[[4.0, -2.0, 1.0]]], query=[[[[1.0, 2.0]]], [[[1.0, 2.0]]]],
                     lens=[1, 0], scale=1.0, sinks=[3.0], return_lse=True)
    out, lse = case.run(oracles.float64)
    np.testing.assert_allclose(out[0, 0, 0], np.array([4.0, -2.0, 1.0]) / (1 + math.exp(2.0)), rtol=1e-15, atol=0)
    assert abs(lse[0, 0, 0] - np.logaddexp(1.0, 3.0)) <= 1e-15
    assert (out[1] == 0).all() and np.isneginf(lse[1]).all()
    for name in ORACLES:  # MLX SDPA takes this sink too (float32)
        got = case.with_(return_lse=False).run(oracles.MLX_ORACLES[name])
        np.testing.assert_allclose(np.array(got)[0, 0, 0], out[0, 0, 0], rtol=0, atol=1e-6)
        assert (np.array(got)[1] == 0).all()


@pytest.mark.clause("sinks", "stability")
@pytest.mark.parametrize("name", [*ORACLES, "float64"])
def test_sink_far_above_the_scores(name):
    """sigma = 200 beside scores near 0: the max must take the sink (e^200 overflows float32):
    o = v e^(s - 200) / (1 + ...) ~ 0, lse = 200 + log(1 + e^(s - 200)) = 200 in float32."""
    case = v2_case(dict(sinks=[200.0] * Hq), lens=[7], query_len=2)
    fn = oracles.float64 if name == "float64" else oracles.MLX_ORACLES[name]
    out = case.run(fn)
    assert float(np.abs(to_numpy(out) if isinstance(out, mx.array) else out).max()) < 1e-80
    if name != "sdpa":
        _, lse = case.with_(return_lse=True).run(fn)
        np.testing.assert_allclose(np.asarray(lse, dtype=np.float64), 200.0, rtol=2 ** -23, atol=0)


@pytest.mark.clause("sinks")
def test_sink_is_never_scaled_or_capped():
    """Zero query (scores 0 for both keys), scale 0.01, cap 0.5, sigma = 2: d = 2 + e^2;
    a sink scaled (0.02) or capped (0.5 tanh 4) would change it."""
    case = hand_call(keys=[[[1.0], [1.0]]], values=[[[1.0], [3.0]]], query=[[[[0.0]]]], scale=0.01, softcap=0.5,
                     sinks=[2.0], return_lse=True)
    out, lse = case.run(oracles.float64)
    assert abs(out[0, 0, 0, 0] - 4.0 / (2 + math.exp(2.0))) <= 1e-15
    assert abs(lse[0, 0, 0] - math.log(2 + math.exp(2.0))) <= 1e-15


@pytest.mark.clause("alibi")
def test_alibi_at_the_first_and_last_visible_key():
    """Zero query, slope 1, values v_j = j. Decode at p = 3 with window 2 sees keys 2, 3:
    biases -1 (first visible) and 0 (last): o = (2 e^-1 + 3) / (e^-1 + 1). Unmasked, the
    prefill row l = 0 of L = 2 sits at p = 2 and sees j = 0..3: biases -2, -1, 0, +1."""
    ctx = 4
    keys, values = [[[0.0]] * ctx], [[[float(j)] for j in range(ctx)]]
    decode = hand_call(keys, values, query=[[[[0.0]]]], scale=1.0, alibi_slopes=[1.0], window=2, return_lse=True)
    out, lse = decode.run(oracles.float64)
    e = math.exp(-1.0)
    assert abs(out[0, 0, 0, 0] - (2 * e + 3) / (e + 1)) <= 1e-15
    assert abs(lse[0, 0, 0] - math.log(e + 1)) <= 1e-15
    prefill = hand_call(keys, values, query=[[[[0.0], [0.0]]]], scale=1.0, alibi_slopes=[1.0], mask=None)
    w = np.exp(np.arange(ctx) - 2.0)
    row0 = prefill.run(oracles.float64)[0, 0, 0, 0]
    assert abs(row0 - (w @ np.arange(ctx)) / w.sum()) <= 1e-14


@pytest.mark.clause("alibi", "sinks")
def test_alibi_offset_is_from_the_rows_own_position():
    """With a sink the bias's absolute offset shows (without one the softmax cancels it):
    prefill L = 2, ctx 4, row 0 at p = 2 sees keys 0..2 with biases -2, -1, 0 (slope 1), sigma 0."""
    keys, values = [[[0.0]] * 4], [[[1.0]] * 4]
    case = hand_call(keys, values, query=[[[[0.0], [0.0]]]], scale=1.0, alibi_slopes=[1.0], sinks=[0.0],
                     return_lse=True)
    out, lse = case.run(oracles.float64)
    d = math.exp(-2) + math.exp(-1) + 1 + 1  # three keys and the sink
    assert abs(out[0, 0, 0, 0] - (d - 1) / d) <= 1e-15 and abs(lse[0, 0, 0] - math.log(d)) <= 1e-15
    d1 = d + math.exp(-3)  # row 1 at p = 3 sees keys 0..3: biases -3..0
    assert abs(out[0, 0, 1, 0] - (d1 - 1) / d1) <= 1e-15


@pytest.mark.clause("lse", "empty_row")
@pytest.mark.parametrize("name", [*ORACLES, "float64"])
def test_lse_of_an_empty_row_is_minus_inf(name):
    case = v2_case(dict(sinks=EXACT_SINKS, return_lse=True), lens=[5, 0], query_len=2)
    if name == "sdpa":
        with pytest.raises(NotApplicable):
            case.run(oracles.sdpa.attention)
        return
    out, lse = case.run(oracles.float64 if name == "float64" else oracles.MLX_ORACLES[name])
    out, lse = np.asarray(to_numpy(out) if isinstance(out, mx.array) else out), np.asarray(lse)
    assert np.isneginf(lse[1]).all() and (out[1] == 0).all()
    assert np.isfinite(lse[0]).all()


@pytest.mark.clause("lse")
def test_lse_equal_scores_is_log_count():
    """Zero query, n visible keys: lse = ln n exactly (natural log, not base 2)."""
    case = hand_call(keys=[[[1.0]] * 5], values=[[[1.0]] * 5], query=[[[[0.0]]]], return_lse=True)
    _, lse = case.run(oracles.float64)
    assert abs(lse[0, 0, 0] - math.log(5)) <= 1e-15


@pytest.mark.clause("value_dim")
def test_value_head_dim_differs_from_key_head_dim_and_scale_defaults_to_dk():
    """Dk = 4 (default scale 1/2), Dv = 3: q . k = 2 for key 0, 0 for key 1: weights e : 1."""
    case = hand_call(keys=[[[1.0, 1.0, 1.0, 1.0], [0.0] * 4]], values=[[[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]]],
                     query=[[[[0.5, 0.5, 0.5, 0.5]]]])
    out = case.run(oracles.float64)
    assert out.shape == (1, 1, 1, 3)
    w0 = math.e / (math.e + 1)
    np.testing.assert_allclose(out[0, 0, 0], w0 * np.array([1.0, 2.0, 3.0]), rtol=1e-15, atol=0)


# ---- merge_states64 ------------------------------------------------------------------------------

@pytest.mark.clause("merge_states")
def test_merge_of_two_empty_states_is_zero_and_minus_inf():
    o, lse = merge_states64(np.full((2, 3), np.nan), np.full(2, -np.inf), np.zeros((2, 3)), np.full(2, -np.inf))
    assert (o == 0).all() and np.isneginf(lse).all()


@pytest.mark.clause("merge_states")
def test_merge_by_hand():
    """Equal lse: the mean, lse + ln 2; an empty side: the other state unchanged (its o never read)."""
    o, lse = merge_states64([[1.0, -2.0]], [0.5], [[3.0, 4.0]], [0.5])
    np.testing.assert_allclose(o, [[2.0, 1.0]], rtol=1e-15)
    np.testing.assert_allclose(lse, [0.5 + math.log(2)], rtol=1e-15)
    o, lse = merge_states64([[np.nan, np.nan]], [-np.inf], [[3.0, 4.0]], [1.25])
    assert np.array_equal(o, [[3.0, 4.0]]) and np.array_equal(lse, [1.25])
    o, lse = merge_states64([[1.0]], [math.log(3)], [[5.0]], [0.0])  # weights 3/4, 1/4
    assert abs(o[0, 0] - 2.0) <= 1e-15 and abs(lse[0] - math.log(4)) <= 1e-15
    o, lse = merge_states64(mx.array([[1.0]]).astype(mx.bfloat16), mx.array([0.0]), [[1.0]], [0.0])
    assert o.dtype == np.float64 and o[0, 0] == 1.0


@pytest.mark.clause("merge_states", "lse", "sinks")
@pytest.mark.parametrize("softcap", [None, 1.5])
def test_cascade_prefix_unmasked_plus_suffix_causal_equals_one_call(softcap):
    """One request of P + L positions, P a page multiple. Prefix call: the P shared keys,
    mask None, with the sinks (counted once); suffix call: the L new keys (the table from
    page P / ps on), causal, no sinks. merge_states64 of the two == the one causal call."""
    P, Lq, ps = 8, 3, 4
    full = v2_case(dict(sinks=ODD_SINKS, softcap=softcap, return_lse=True), lens=[P + Lq, P + Lq],
                   query_len=Lq, page_size=ps, seed=13)
    prefix = full.with_(context_lens=mx.array([P, P], dtype=mx.int32), mask=None)
    suffix = full.with_(block_table=full.block_table[:, P // ps:], context_lens=mx.array([Lq, Lq], dtype=mx.int32),
                        sinks=None)
    want, want_lse = full.run(oracles.float64)
    o, lse = merge_states64(*prefix.run(oracles.float64), *suffix.run(oracles.float64))
    np.testing.assert_allclose(o, want, rtol=0, atol=1e-13)
    np.testing.assert_allclose(lse, want_lse, rtol=0, atol=1e-13)
    # the float32 oracles' partial states merge within the rule of the one call
    (ref, ref_lse), (allowed, allowed_lse) = reference(full.args(), full.kwargs())
    o32, lse32 = merge_states64(*prefix.run(oracles.equation.attention), *suffix.run(oracles.dense.attention))
    assert max_abs_error(o32, ref) <= 2 * allowed and lse_error(lse32, ref_lse) <= 2 * allowed_lse


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
