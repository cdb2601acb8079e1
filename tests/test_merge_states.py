"""`impl.merge_states` (REFERENCE.md 1b): the formula, empty states, and its rejections.

The cascade (a prefix attended once, suffixes separately, merged == one call) is
tests/test_cascade.py; here the merge itself, against the float64 formula
(oracles.merge_states64) and by hand.
"""

import mlx.core as mx
import numpy as np
import pytest

import impl
from fixtures import bits
from oracles import merge_states64

pytestmark = [pytest.mark.correctness, pytest.mark.clause("merge_states"),
              pytest.mark.builtin_only("pagecheck's public merge_states")]

NEG_INF = float("-inf")


def _states(seed: int, shape=(2, 3, 4), dv: int = 8, dtype=mx.float32):
    rng = np.random.default_rng(seed)
    o = [mx.array(rng.standard_normal(shape + (dv,)).astype(np.float32)).astype(dtype) for _ in range(2)]
    lse = [mx.array(rng.uniform(-5, 40, shape).astype(np.float32)) for _ in range(2)]
    return o[0], lse[0], o[1], lse[1]


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_merge_matches_the_float64_formula(dtype):
    o_a, lse_a, o_b, lse_b = _states(1, dtype=dtype)
    o, lse = impl.merge_states(o_a, lse_a, o_b, lse_b)
    assert o.dtype == dtype and lse.dtype == mx.float32 and o.shape == o_a.shape and lse.shape == lse_a.shape
    want_o, want_lse = merge_states64(*(np.array(x.astype(mx.float32)) for x in (o_a, lse_a, o_b, lse_b)))
    u = {mx.float32: 2.0 ** -24, mx.float16: 2.0 ** -11, mx.bfloat16: 2.0 ** -8}[dtype]
    assert np.abs(np.array(o.astype(mx.float32)) - want_o).max() <= 4 * u * np.abs(want_o).max() + 1e-6
    assert np.abs(np.array(lse) - want_lse).max() <= 1e-6 * np.abs(want_lse).max()


def test_two_empty_states_give_zeros_and_minus_inf():
    """-inf - -inf is NaN: a merge that subtracts the larger lse from each must not (FlashInfer #4051)."""
    o_a, _, o_b, _ = _states(2)
    empty = mx.full(o_a.shape[:-1], NEG_INF)
    o, lse = impl.merge_states(mx.zeros_like(o_a), empty, mx.zeros_like(o_b), empty)
    assert np.array_equal(np.array(o), np.zeros(o_a.shape)) and np.isneginf(np.array(lse)).all()


def test_an_empty_side_leaves_the_other_exactly():
    """By hand: lse_b = -inf gives weight e^(lse_a - lse_a) = 1 to o_a and 0 to o_b."""
    o_a, lse_a, o_b, _ = _states(3)
    o, lse = impl.merge_states(o_a, lse_a, o_b * float("nan"), mx.full(lse_a.shape, NEG_INF))
    assert bits(o) == bits(o_a) and bits(lse) == bits(lse_a)


def test_equal_states_by_hand():
    """Two states with the same lse x and outputs 1 and 3: lse = x + ln 2, o = 2."""
    shape = (1, 2, 1)
    lse_in = mx.full(shape, 0.75)
    o, lse = impl.merge_states(mx.ones(shape + (4,)), lse_in, mx.full(shape + (4,), 3.0), lse_in)
    assert np.allclose(np.array(o), 2.0, rtol=0, atol=1e-6)
    assert np.allclose(np.array(lse), 0.75 + np.log(2.0), rtol=0, atol=1e-6)


def test_huge_lse_gap_stays_finite():
    o_a, lse_a, o_b, lse_b = _states(4)
    o, lse = impl.merge_states(o_a, lse_a + 1e30, o_b, lse_b)
    assert bits(o) == bits(o_a) and np.isfinite(np.array(lse)).all()


BAD = {
    "o-dtypes-differ": (lambda a, la, b, lb: (a, la, b.astype(mx.float16), lb), r"o_a and o_b must share a float dtype"),
    "o-int": (lambda a, la, b, lb: (a.astype(mx.int32), la, b.astype(mx.int32), lb), r"must share a float dtype"),
    "lse-float16": (lambda a, la, b, lb: (a, la.astype(mx.float16), b, lb), r"lse_a must be float32, got float16"),
    "o-shapes-differ": (lambda a, la, b, lb: (a, la, b[..., :4], lb), r"o_a shape \(2, 3, 4, 8\) differs from o_b shape"),
    "lse-shape": (lambda a, la, b, lb: (a, la, b, lb[:, :1]), r"lse_b shape \(2, 1, 4\) is not the outputs' shape"),
    "o-not-array": (lambda a, la, b, lb: (np.array(a), la, b, lb), r"o_a must be an mlx.core.array"),
}


@pytest.mark.clause("inv10", "reject.merge")
@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_merge_inputs_are_rejected_with_nothing_changed(name):
    mutate, message = BAD[name]
    states = _states(5)
    before = [bits(x) for x in states]
    with pytest.raises(impl.ContractViolation, match=message) as info:
        impl.merge_states(*mutate(*states))
    expected_clause = "type" if name == "o-not-array" else "merge"
    assert info.value.clause == expected_clause
    assert [bits(x) for x in states] == before
