"""Contract-v2 conventions (conformance/formats/conventions.py): each converter against the
definition in its table, each call without a faithful image a skip with the reason, and
every v2 kernel of tests/format_impls.py (written from the same definitions, not through
the converters) equal to the float64 oracle once converted; a kernel that writes another
convention than it declares fails.

| check                                    | what it proves                                   |
|------------------------------------------|--------------------------------------------------|
| ALiBi biases                             | each convention's bias by its formula, on numbers |
| `context_end`                            | same softmax, lse shifted by slope * (p - ctx + 1), converted back; with sinks no image |
| `abs_distance`                           | equal to pagecheck's on causal keys only; mask=None with slopes no image |
| `bias_before_cap`                        | equal without a cap; soft-cap with slopes no image |
| `base2`, `+inf`                          | lse2 * ln 2; +inf -> -inf on an empty row only    |
| `Rows`, `unpack_lse`                     | where each lse entry sits; packed [T, Hq] -> [B, Hq, L], -inf padding |
| the v2 kernels                           | out and lse equal the float64 oracle's, in every format and convention |
| a misdeclared kernel                     | its lse differs from the oracle's                 |
"""

import math

import mlx.core as mx
import numpy as np
import pytest

from conformance import formats
from conformance.bridges import from_numpy
from conformance.capabilities import CHOICES, Capabilities
from conformance.formats import NotExpressible, queries
from conformance.formats.conventions import Rows, alibi_bias, alibi_expressible, lse_back
from contract import ScorePipeline
from fixtures import paged_case
from oracles import float64
from tests import format_impls

SLOPES = mx.array([0.5, 0.25, -0.125, 1.0])
SINKS = mx.array([0.5, -1.0, 3.0, -20.0])


def _logsumexp(s) -> float:
    m = s.max()
    return float(m + np.log(np.exp(s - m).sum()))


def _softmax(s):
    w = np.exp(s - s.max())
    return w / w.sum()


def _caps(**conv) -> Capabilities:
    return Capabilities.declared(conv)


# -- ALiBi ---------------------------------------------------------------------------------

def test_alibi_biases_follow_the_table():
    keys = np.arange(6)  # a request of 6 keys, the query at p = 3
    np.testing.assert_array_equal(alibi_bias("position", 0.5, keys, 3, 6), [-1.5, -1, -0.5, 0, 0.5, 1])
    np.testing.assert_array_equal(alibi_bias("bias_before_cap", 0.5, keys, 3, 6), [-1.5, -1, -0.5, 0, 0.5, 1])
    np.testing.assert_array_equal(alibi_bias("context_end", 0.5, keys, 3, 6), [-2.5, -2, -1.5, -1, -0.5, 0])
    np.testing.assert_array_equal(alibi_bias("abs_distance", 0.5, keys, 3, 6), [-1.5, -1, -0.5, 0, -0.5, -1])
    with pytest.raises(ValueError, match="unknown ALiBi convention"):
        alibi_bias("slope_first", 0.5, keys, 3, 6)


@pytest.mark.parametrize("p", [0, 3, 5])
def test_context_end_keeps_the_softmax_and_shifts_the_lse_by_a_row_constant(p):
    rng = np.random.default_rng(p)
    s, keys, ctx, slope = rng.standard_normal(6), np.arange(6), 6, 0.75
    ours, theirs = s + alibi_bias("position", slope, keys, p, ctx), s + alibi_bias("context_end", slope, keys, p, ctx)
    np.testing.assert_allclose(_softmax(theirs), _softmax(ours), rtol=1e-12)
    assert _logsumexp(theirs) - _logsumexp(ours) == pytest.approx(slope * (p - ctx + 1), abs=1e-12)
    # ... but with a sink, which no bias shifts, the weights of the keys differ (no image)
    sigma = 0.3
    with_sink = lambda x: np.exp(x) / (np.exp(x).sum() + np.exp(sigma))  # noqa: E731
    if p != ctx - 1:
        assert not np.allclose(with_sink(theirs), with_sink(ours))


def test_context_end_lse_is_converted_back_per_row():
    """A padded lse [B, Hq, L] (and a packed one [T, Hq]) of a context_end kernel, from its
    definition, comes back as pagecheck's: -slope_h * (l - L + 1) per row; an empty slot stays -inf."""
    rng = np.random.default_rng(1)
    lens, L, Hq = [7, 0, 4], 3, 4
    slopes = np.array(SLOPES)
    ours = np.full((3, Hq, L), -np.inf)
    theirs = np.full((3, Hq, L), -np.inf)
    for b, ctx in enumerate(lens):
        for h in range(Hq):
            for l in range(L if ctx else 0):
                p = ctx - L + l
                s, keys = rng.standard_normal(p + 1), np.arange(p + 1)  # causal: keys 0..p
                ours[b, h, l] = _logsumexp(s + alibi_bias("position", slopes[h], keys, p, ctx))
                theirs[b, h, l] = _logsumexp(s + alibi_bias("context_end", slopes[h], keys, p, ctx))
    pipeline = ScorePipeline(alibi_slopes=SLOPES, return_lse=True)
    caps = _caps(alibi_convention="context_end")
    back = lse_back(caps, mx.array(theirs.astype(np.float32)), pipeline, Rows.padded(mx.array(lens), L))
    assert back.dtype == mx.float32
    np.testing.assert_allclose(np.array(back), ours, rtol=1e-6, atol=1e-6)
    assert np.isneginf(np.array(back)[1]).all()
    # the packed form of the same rows: requests 0 and 2 have L rows each, the empty slot none
    cu = mx.array([0, L, L, 2 * L])
    packed = np.concatenate([theirs[0].T, theirs[2].T])  # [T, Hq]
    back = lse_back(caps, mx.array(packed.astype(np.float32)), pipeline, Rows.packed(cu, mx.array(lens)))
    np.testing.assert_allclose(np.array(back), np.concatenate([ours[0].T, ours[2].T]), rtol=1e-6, atol=1e-6)


def test_abs_distance_equals_position_on_causal_keys_only():
    keys, p, ctx = np.arange(8), 5, 8
    pos, fa2 = alibi_bias("position", 0.5, keys, p, ctx), alibi_bias("abs_distance", 0.5, keys, p, ctx)
    np.testing.assert_array_equal(pos[keys <= p], fa2[keys <= p])
    assert (pos[keys > p] != fa2[keys > p]).all()
    alibi_expressible("abs_distance", ScorePipeline(alibi_slopes=SLOPES))  # causal: the same
    alibi_expressible("abs_distance", ScorePipeline(mask=None))  # no slopes: nothing differs
    with pytest.raises(NotExpressible, match=r"abs_distance\) with mask=None"):
        alibi_expressible("abs_distance", ScorePipeline(mask=None, alibi_slopes=SLOPES))


def test_bias_before_cap_equals_position_without_a_cap_only():
    s, bias, c = np.array([3.0, -1.0, 7.5]), np.array([-1.0, -0.5, 0.0]), 2.0
    assert not np.allclose(c * np.tanh((s + bias) / c), c * np.tanh(s / c) + bias)
    alibi_expressible("bias_before_cap", ScorePipeline(alibi_slopes=SLOPES))
    alibi_expressible("bias_before_cap", ScorePipeline(softcap=c))
    with pytest.raises(NotExpressible, match="before the soft-cap"):
        alibi_expressible("bias_before_cap", ScorePipeline(softcap=c, alibi_slopes=SLOPES))


def test_context_end_with_sinks_has_no_image():
    alibi_expressible("context_end", ScorePipeline(alibi_slopes=SLOPES))
    alibi_expressible("context_end", ScorePipeline(sinks=SINKS))
    with pytest.raises(NotExpressible, match="sink is not"):
        alibi_expressible("context_end", ScorePipeline(alibi_slopes=SLOPES, sinks=SINKS))
    for conv in CHOICES["alibi_convention"]:  # pagecheck's own and any call without slopes: always
        alibi_expressible(conv, ScorePipeline(mask=None, softcap=1.0, sinks=SINKS))


# -- the lse -------------------------------------------------------------------------------

def _rows(lens=(5, 0, 3), L=2):
    return Rows.padded(mx.array(list(lens), dtype=mx.int32), L)


def test_base2_lse_is_multiplied_by_ln2():
    lse = np.array([[[1.5, -2.0]], [[-np.inf, -np.inf]], [[40.0, 0.0]]])  # [B = 3, Hq = 1, L = 2]
    back = lse_back(_caps(lse_convention="base2"), mx.array((lse / math.log(2)).astype(np.float32)),
                    ScorePipeline(), _rows())
    np.testing.assert_allclose(np.array(back), lse, rtol=1e-6)


def test_plus_inf_empty_lse_becomes_minus_inf_on_empty_rows_only():
    lse = np.array([[[1.0, np.inf]], [[np.inf, np.inf]], [[-np.inf, 2.0]]], dtype=np.float32)
    back = np.array(lse_back(_caps(empty_lse="+inf"), mx.array(lse), ScorePipeline(), _rows()))
    assert np.isneginf(back[1]).all()  # the empty slot
    assert back[0, 0, 1] == np.inf  # +inf on a row with keys stays: the check fails it
    assert np.isneginf(back[2, 0, 0]) and back[2, 0, 1] == 2.0 and back[0, 0, 0] == 1.0
    both = lse_back(_caps(empty_lse="+inf", lse_convention="base2"), mx.array(lse / math.log(2)),
                    ScorePipeline(), _rows())
    assert np.isneginf(np.array(both)[1]).all()
    np.testing.assert_allclose(np.array(both)[2, 0, 1], 2.0, rtol=1e-6)


def test_lse_back_keeps_the_dtype_and_leaves_what_it_cannot_read():
    caps = _caps(lse_convention="base2")
    half = mx.array(np.full((3, 1, 2), 2.0, dtype=np.float32)).astype(mx.bfloat16)
    back = lse_back(caps, half, ScorePipeline(), _rows())
    assert back.dtype == mx.bfloat16  # a wrong lse dtype still fails the check
    wrong = mx.zeros((3, 2))
    assert lse_back(caps, wrong, ScorePipeline(), _rows()) is wrong  # another shape: untouched
    assert lse_back(caps, "lse", ScorePipeline(), _rows()) == "lse"
    plain = mx.zeros((3, 1, 2))
    assert lse_back(Capabilities(), plain, ScorePipeline(), _rows()) is plain  # pagecheck's own: nothing to do


def test_rows_say_where_each_lse_entry_sits():
    rows = Rows.padded(mx.array([5, 0, 3]), 3)
    assert rows.empty.ravel().tolist() == [False, True, False]
    assert rows.to_end[0, 0].tolist() == [-2, -1, 0] and rows.head_axis == 1
    packed = Rows.packed(mx.array([0, 2, 2, 5]), mx.array([7, 0, 3]))
    assert packed.to_end.ravel().tolist() == [-1, 0, -2, -1, 0] and not packed.empty.any()


def test_unpack_lse_places_each_requests_entries_at_its_last_rows():
    lse = mx.array(np.arange(10, dtype=np.float32).reshape(5, 2))  # T = 5 rows, Hq = 2
    out = np.array(queries.unpack_lse(lse, mx.array([0, 2, 2, 5]), 3))
    assert out.shape == (3, 2, 3)
    np.testing.assert_array_equal(out[0, :, 1:], np.array([[0, 2], [1, 3]]))
    assert np.isneginf(out[0, :, 0]).all() and np.isneginf(out[1]).all()
    np.testing.assert_array_equal(out[2], np.array([[4, 6, 8], [5, 7, 9]]))
    assert queries.unpack_lse(lse.astype(mx.float16), mx.array([0, 2, 2, 5]), 3).dtype == mx.float16
    with pytest.raises(AssertionError, match="expected"):
        queries.unpack_lse(lse[:4], mx.array([0, 2, 2, 5]), 3)


@pytest.mark.parametrize("key,value", [("lse_convention", "log2"), ("empty_lse", "inf"),
                                       ("alibi_convention", "vllm"), ("sinks", "yes"), ("lse", 1)])
def test_bad_v2_declarations_are_usage_errors(key, value):
    with pytest.raises(ValueError, match=key):
        Capabilities.declared({key: value})


def test_a_convention_converts_without_changing_the_signature():
    caps = _caps(lse_convention="base2")
    assert caps.converted and not caps.native_call
    assert not Capabilities.declared({"sinks": True, "lse": True}).converted
    case = paged_case(context_lens=[5, 0], query_len=2, head_dim=8, seed=4).with_(return_lse=True)
    call = formats.native(caps, *case.args(), **case.kwargs())
    assert call.args == case.args() and call.kwargs == case.kwargs()  # the contract's own call
    out = mx.zeros((2, 4, 2, 8))
    lse = mx.full((2, 4, 2), 1.0)
    back_out, back_lse = call.output((out, lse))
    assert back_out is out and np.allclose(np.array(back_lse), math.log(2))


# -- the v2 kernels end to end -------------------------------------------------------------

PIPELINES = {
    "softcap-alibi-sinks-lse": dict(softcap=4.0, alibi_slopes=SLOPES, sinks=SINKS, return_lse=True),
    "alibi-lse-prefill": dict(alibi_slopes=SLOPES, return_lse=True),
    "sinks-window-lse": dict(sinks=SINKS, window=3, return_lse=True),
    "unmasked-alibi-lse": dict(mask=None, alibi_slopes=SLOPES, return_lse=True),
    "softcap-alibi": dict(softcap=2.0, alibi_slopes=SLOPES),
    "lse-only": dict(return_lse=True),
}
# kernel -> {pipeline: the reason it has no image}
NO_IMAGE = {
    "v2_flashinfer_like": {"softcap-alibi-sinks-lse": "before the soft-cap", "softcap-alibi": "before the soft-cap"},
    "v2_fa2_like": {"unmasked-alibi-lse": "abs_distance"},
    "v2_vllm_like": {"softcap-alibi-sinks-lse": "sink is not"},
}


def _v2_case(dtype, value_dim=None, **pipeline):
    case = paged_case(context_lens=[11, 0, 6], query_len=3, q_heads=4, kv_heads=2, head_dim=16, page_size=4,
                      dtype=dtype, seed=8)
    if value_dim:  # Dv != Dk: the first Dv of each value row (NaN in unused slots kept)
        case = case.with_(value_pages=case.value_pages[..., :value_dim])
    return case.with_(**pipeline)


def _check_against_float64(case, result):
    ref = float64(*case.args(), **case.kwargs())
    ref, ref_lse = ref if case.return_lse else (ref, None)
    out, lse = result if case.return_lse else (result, None)
    assert out.dtype == case.dtype and out.shape == ref.shape
    unit = {mx.float32: 2.0 ** -24, mx.float16: 2.0 ** -11, mx.bfloat16: 2.0 ** -8}[case.dtype]
    got = np.array(out.astype(mx.float32), dtype=np.float64)
    assert np.abs(got - ref).max() <= 2 * unit * np.abs(ref).max() + 1e-7
    if ref_lse is not None:
        assert lse.dtype == mx.float32 and lse.shape == ref_lse.shape
        got = np.array(lse, dtype=np.float64)
        empty = np.isneginf(ref_lse)
        assert np.isneginf(got[empty]).all(), "an empty row's lse must be -inf"
        assert np.abs(got[~empty] - ref_lse[~empty]).max() <= 1e-6 * max(1.0, np.abs(ref_lse[~empty]).max())


@pytest.mark.parametrize("pipeline", sorted(PIPELINES))
@pytest.mark.parametrize("name", format_impls.CORRECT_V2)
def test_v2_kernel_matches_the_float64_oracle_once_converted(name, pipeline):
    kernel = getattr(format_impls, name)
    dtype = "float16" if name == "v2_vllm_like" else "float32"
    for value_dim in (None, 6):
        case = _v2_case(dtype, value_dim, **PIPELINES[pipeline])
        why = NO_IMAGE.get(name, {}).get(pipeline)
        if why:
            with pytest.raises(NotExpressible, match=why):
                case.run(kernel)
            continue
        _check_against_float64(case, case.run(kernel))


def test_v2_kernel_in_bfloat16_and_packed_mixed_lengths():
    from fixtures.mixed import mixed_case

    case = _v2_case("bfloat16", 6, **PIPELINES["softcap-alibi-sinks-lse"])
    _check_against_float64(case, case.run(format_impls.v2_nhd_varlen))
    mixed = mixed_case(context_lens=[9, 0, 14], query_lens=[1, 0, 5], q_heads=4, kv_heads=2, head_dim=8,
                       page_size=4, seed=2)
    kwargs = dict(alibi_slopes=SLOPES, sinks=SINKS, return_lse=True)
    out, lse = format_impls.v2_nhd_varlen.packed(*mixed.args(), **{**mixed.kwargs(), **kwargs})
    assert out.shape == (6, 4, 8) and lse.shape == (6, 4)
    for b in (0, 2):
        alone = mixed.request(b).with_(**kwargs)
        ref, ref_lse = float64(*alone.args(), **alone.kwargs())
        np.testing.assert_allclose(np.array(mixed.rows(out, b)), ref, atol=1e-6)
        cu = np.array(mixed.cu_seqlens_q)
        np.testing.assert_allclose(np.array(lse[int(cu[b]):int(cu[b + 1])]).T[None], ref_lse, rtol=1e-6)


def test_context_end_kernel_packed_lse_is_converted_per_row():
    from fixtures.mixed import mixed_case

    fmt = dict(layout="nhd", query_packing="varlen", alibi_convention="context_end")
    kernel = from_numpy(format_impls.native_reference(**fmt), validates_input=False, **fmt, **format_impls.V2)
    mixed = mixed_case(context_lens=[9, 14], query_lens=[3, 5], q_heads=4, kv_heads=2, head_dim=8, page_size=4,
                       seed=3)
    kwargs = dict(alibi_slopes=SLOPES, return_lse=True)
    out, lse = kernel.packed(*mixed.args(), **{**mixed.kwargs(), **kwargs})
    cu = np.array(mixed.cu_seqlens_q)
    for b in (0, 1):
        alone = mixed.request(b).with_(**kwargs)
        ref, ref_lse = float64(*alone.args(), **alone.kwargs())
        np.testing.assert_allclose(np.array(mixed.rows(out, b)), ref, atol=1e-6)
        np.testing.assert_allclose(np.array(lse[int(cu[b]):int(cu[b + 1])]).T[None], ref_lse, rtol=1e-6)


@pytest.mark.parametrize("convention", [dict(lse_convention="base2"), dict(empty_lse="+inf"),
                                        dict(alibi_convention="context_end")])
def test_a_kernel_writing_an_undeclared_convention_fails(convention):
    """The same kernel declaring pagecheck's conventions while writing another: its lse
    is off (base 2, +inf on the empty slot, rows shifted by slope * (p - ctx + 1))."""
    kernel = from_numpy(format_impls.native_reference(layout="nhd", **convention), validates_input=False,
                        layout="nhd", **format_impls.V2)
    case = _v2_case("float32", **PIPELINES["alibi-lse-prefill"])
    with pytest.raises(AssertionError):
        _check_against_float64(case, case.run(kernel))
    declared = from_numpy(format_impls.native_reference(layout="nhd", **convention), validates_input=False,
                          layout="nhd", **convention, **format_impls.V2)
    _check_against_float64(case, case.run(declared))


def test_load_converts_an_mlx_kernel_that_declares_only_a_convention(monkeypatch):
    """An MLX kernel in the contract's signature writing FlashInfer's base-2 lse: `load`
    puts the conversion in front of it (no format key needed)."""
    import sys
    import types

    import impl
    from conformance import load

    def kernel(*args, **kwargs):
        out = impl.paged_attention(*args, **kwargs)
        return (out[0], out[1] / math.log(2)) if isinstance(out, tuple) else out

    kernel.pagecheck_capabilities = {"lse_convention": "base2", "lse": True, "sinks": True}
    monkeypatch.setitem(sys.modules, "base2_mlx_kernel", types.SimpleNamespace(kernel=kernel))
    loaded = load("base2_mlx_kernel:kernel")
    assert loaded.caps.lse_convention == "base2" and loaded.fn is not kernel
    case = _v2_case("float32", sinks=SINKS, return_lse=True)
    _check_against_float64(case, case.run(loaded))
    with pytest.raises(AssertionError):  # the kernel itself, unconverted
        _check_against_float64(case, case.run(kernel))
