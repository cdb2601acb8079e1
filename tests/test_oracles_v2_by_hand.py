"""Contract v2 in the float64 oracle (REFERENCE.md 1b), against small answers derived by
hand here: a saturated cap at |s/c| = 1e4, a sink beside one visible key, ALiBi at the
first and last visible key (prefill rows, unmasked rows seeing keys after p), the LSE of
an empty row, `merge_states64` of empty states and by hand, and a cascade (prefix
unmasked + suffix causal, merged) equal to one call. Each MLX oracle against the float64
one, feature by feature, is tests/test_oracles_v2.py.
"""

import math

import mlx.core as mx
import numpy as np
import pytest

import oracles
from fixtures import paged_case, to_numpy
from oracles import NotApplicable, merge_states64
from oracles.compare import reference
from oracles.tolerance import lse_error, max_abs_error
from tests.v2_cases import EXACT_SINKS, ODD_SINKS, ORACLES, Hq, f32, v2_case

pytestmark = pytest.mark.correctness


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
    opts = {k: (f32(v) if k in ("alibi_slopes", "sinks") else v) for k, v in options.items()}
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
