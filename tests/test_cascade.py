"""Cascade attention (REFERENCE.md 1b): a shared prefix attended once (unmasked), the
suffix causally over its own pages, both with return_lse, merged by `impl.merge_states`,
equal one call over the whole context (fixtures/cascade.py builds the split).

Splits at a page boundary (the suffix reads the case's own pages) and mid-page (the
suffix re-paged into a fresh pool); sinks passed to exactly one of the two calls, either
one; soft-cap, GQA, unmasked calls, an empty slot and Dk != Dv. The split itself is
checked first in float64 (oracle partials merged by the float64 formula == the float64
one call), so a failure of the kernel check is the kernel's or the merge's, not the
split's. The merged state meets the tolerance rule (output) and the LSE rule against the
float64 one call, as the one call itself must.
"""

import mlx.core as mx
import numpy as np
import pytest

import impl
import oracles
from fixtures import hand_case, paged_case, to_numpy
from fixtures.cascade import cascade_split
from oracles.compare import reference
from oracles.tolerance import Verdict, lse_error, lse_scale, max_abs_error, ref_scale

pytestmark = [pytest.mark.correctness, pytest.mark.clause("merge_states", "lse")]

SINKS = [0.5, -1.0, 2.0, 3.5]  # one per query head (paged_case: Hq = 4)


def _random(**changes):
    """Hq 4, Hkv 2, D 16, page size 4; request 1 is an empty slot."""
    return paged_case(**{**dict(context_lens=[21, 0, 14], query_len=3, page_size=4, seed=7), **changes})


def _sinks():
    return mx.array(np.array(SINKS, dtype=np.float32))


CASES = {  # name -> (case builder, n0)
    "plain-boundary": (lambda: _random(), 8),
    "plain-mid-page": (lambda: _random(), 6),
    "sinks-prefix-mid-page": (lambda: _random().with_(sinks=_sinks()), 5),
    "sinks-suffix-boundary": (lambda: _random().with_(sinks=_sinks()), 8),
    "softcap-sinks-mid-page": (lambda: _random().with_(softcap=1.5, sinks=_sinks()), 7),
    "unmasked-mid-page": (lambda: _random(mask=None), 9),
    "decode-mid-page": (lambda: _random(context_lens=[9, 30], query_len=1, seed=3), 3),
    "mla-192-128-boundary": (lambda: hand_case("value_dim_mla_192_128"), 16),
    "mla-192-128-mid-page": (lambda: hand_case("value_dim_mla_192_128"), 10),
}
NAMES = list(CASES)


def _split_for(name: str):
    build, n0 = CASES[name]
    case = build()
    return cascade_split(case, n0, sinks_to="suffix" if "sinks-suffix" in name else "prefix")


@pytest.mark.parametrize("name", NAMES)
def test_the_split_is_exact_in_float64(name):
    """The helper, checked on the float64 oracle: partials merged in float64 == one call."""
    split = _split_for(name)
    assert split.mid_page == ("mid-page" in name)
    assert (split.prefix.sinks is None) + (split.suffix.sinks is None) == (1 if split.whole.sinks is not None else 2)
    want, want_lse = split.whole.run(oracles.float64)
    o, lse = oracles.merge_states64(*split.prefix.run(oracles.float64), *split.suffix.run(oracles.float64))
    assert np.array_equal(np.isneginf(lse), np.isneginf(want_lse))
    assert np.abs(o - want).max() <= 1e-12 * max(1.0, np.abs(want).max())
    finite = np.isfinite(want_lse)
    assert np.abs(lse[finite] - want_lse[finite]).max() <= 1e-12 * max(1.0, np.abs(want_lse[finite]).max())


def test_a_sink_in_both_calls_is_counted_twice():
    """Why the split gives the sinks to one call only: in both, the merge counts them twice."""
    split = _split_for("sinks-prefix-mid-page")
    want, _ = split.whole.run(oracles.float64)
    twice = split.suffix.with_(sinks=split.prefix.sinks)
    o, _ = oracles.merge_states64(*split.prefix.run(oracles.float64), *twice.run(oracles.float64))
    assert np.abs(o - want).max() > 1e-3


@pytest.mark.parametrize("name", NAMES)
def test_cascade_merge_equals_one_call(name, attention, error_log):
    """prefix and suffix through the implementation, merged by impl.merge_states: the
    merged (out, lse) meets the tolerance and LSE rules against the float64 one call, as
    the implementation's own one call does; empty slots give (0, -inf), no NaN."""
    split = _split_for(name)
    whole = split.whole
    (ref, ref_lse), (allowed, allowed_lse) = reference(whole.args(), whole.kwargs())
    one = whole.run(attention)
    parts = split.prefix.run(attention), split.suffix.run(attention)
    o, lse = impl.merge_states(*parts[0], *parts[1])
    mx.eval(o, lse)
    assert o.dtype == whole.dtype and o.shape == one[0].shape and lse.dtype == mx.float32
    assert not np.isnan(to_numpy(o)).any() and not np.isnan(np.array(lse)).any(), f"{name}: NaN in the merge"
    for what, (out, out_lse) in (("one call", one), ("merged cascade", (o, lse))):
        verdict = Verdict(max_abs_error(out, ref), allowed, ref_scale(ref))
        error_log.record(whole.dtype, "float64", verdict)
        assert verdict.ok, f"{name}: {what}: output {verdict}"
        lse_verdict = Verdict(lse_error(out_lse, ref_lse), allowed_lse, lse_scale(ref_lse))
        assert lse_verdict.ok, f"{name}: {what}: lse (-inf exactly at empty slots) {lse_verdict}"
    empty = np.array(whole.context_lens) == 0
    assert not to_numpy(o)[empty].any() and np.isneginf(np.array(lse)[empty]).all()


def test_merging_two_empty_states_gives_zeros_and_minus_inf(attention):
    """A batch of empty slots: both partial calls return (0, -inf); their merge is (0, -inf),
    not the NaN of -inf - -inf (FlashInfer #4051)."""
    case = paged_case(context_lens=[0, 0], query_len=2, page_size=4, seed=1)
    split = cascade_split(case.with_(sinks=_sinks()), 2)
    parts = split.prefix.run(attention), split.suffix.run(attention)
    for out, lse in parts:
        assert not to_numpy(out).any() and np.isneginf(np.array(lse)).all()
    o, lse = impl.merge_states(*parts[0], *parts[1])
    assert not np.isnan(to_numpy(o)).any() and not to_numpy(o).any(), "merged empty states: not zeros"
    assert np.isneginf(np.array(lse)).all(), "merged empty states: lse not -inf"


@pytest.mark.parametrize("bad", ["window", "alibi", "short-prefix", "short-suffix", "sinks_to"])
def test_splits_that_would_not_equal_the_call_are_refused(bad):
    case = paged_case(context_lens=[12], query_len=3, page_size=4, seed=2)
    kwargs, n0 = {}, 6
    if bad == "window":
        case = case.with_(window=4)
    elif bad == "alibi":
        case = case.with_(alibi_slopes=mx.array(np.ones(4, dtype=np.float32)))
    elif bad == "short-prefix":
        n0 = 2
    elif bad == "short-suffix":
        n0 = 10
    else:
        kwargs = {"sinks_to": "both"}
    with pytest.raises(ValueError):
        cascade_split(case, n0, **kwargs)
