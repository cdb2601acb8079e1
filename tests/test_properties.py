"""Property tests of the operator on random paged layouts (fixtures/strategies.py).

Each example is one `paged_case` layout: random shapes (D and page sizes off the
multiples of 16, GQA ratios 1..4, L on both the decode and the prefill schedule),
random page ids with free pages between them, NaN in every free page and tail slot,
empty rows. The kernel must match the float64 oracle under the tolerance rule, return
no NaN, keep dtype and shape, give empty rows exact zeros, compute each request as it
would alone (6) and each prefill row as its one-token decode (8); rejected metadata
raises `ContractViolation` before the kernel is reached; unread table entries are
never checked or read.

Layouts are drawn within the declaration of the implementation under test
(`layouts(caps)`), so none is filtered out; a check the declaration rules out
everywhere (no declared dtype fits, or a rejection that needs L >= 2 without prefill)
is skipped once at collection with the reason, before hypothesis runs.

Each test runs PROPERTY_EXAMPLES_FACTOR times the hypothesis profile's max_examples
(conftest.py): an example costs milliseconds, a state-machine example (the profile's
other user) a hundred times more.
"""

from unittest import mock

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st

import impl
import impl.attention
from conformance.implementation import assert_same_output
from conformance.plugin import current
from fixtures import bits, paged_case, to_numpy
from fixtures.strategies import REJECTIONS, applicable, corruptions, layouts, ruled_out
from oracles.compare import reference
from oracles.tolerance import Verdict, max_abs_error, ref_scale

pytestmark = pytest.mark.correctness

PROPERTY_EXAMPLES_FACTOR = 4
examples = settings(max_examples=PROPERTY_EXAMPLES_FACTOR * settings.default.max_examples)
# the implementation under test is known before collection (conformance/plugin.py), so
# the strategies and the skips below can read its declaration
UNDER_TEST = current()
CAPS = UNDER_TEST.caps if UNDER_TEST is not None else None


def declared(kind: str | None = None):
    """Skips a check the declaration rules out everywhere, once, with the reason."""
    reason = ruled_out(CAPS, kind)
    if reason is None:
        return pytest.mark.skipif(False, reason="")
    return pytest.mark.skipif(True, reason=f"not declared by {UNDER_TEST.name}: {reason}")


def _case(layout, attention):
    """The drawn layout's case. A draw outside the declaration is a bug of layouts(caps):
    it fails here instead of skipping the whole check at its first call."""
    case = paged_case(**layout)
    reason = attention.unsupported(*case.args(), **case.kwargs())
    assert reason is None, f"layouts(caps) drew a call outside the declaration: {reason}"
    return case


def _verdict(case, out) -> Verdict:
    ref, allowed = reference(case.args(), case.kwargs())
    return Verdict(max_abs_error(out, ref), allowed, ref_scale(ref))


@pytest.mark.clause("oracle")
@declared()
@examples
@given(layout=layouts(CAPS))
def test_kernel_matches_float64_oracle(layout, attention, error_log):
    case = _case(layout, attention)
    out = case.run(attention)
    assert out.dtype == case.dtype and out.shape == case.query.shape
    got = to_numpy(out)
    assert np.isfinite(got).all(), "NaN or inf in the output: an unused slot or free page was read"
    empty = np.array(case.context_lens) == 0
    assert not got[empty].any(), "an empty row must be exact zeros"
    verdict = _verdict(case, out)
    note(str(verdict))
    error_log.record(case.dtype, "float64", verdict)
    assert verdict.ok, verdict


@pytest.mark.clause("inv6", "inv8")
@declared()
@examples
@given(layout=layouts(CAPS), data=st.data())
def test_batch_and_schedule_invariance(layout, data, attention):
    """6: a request alone gives the bits it gets in the batch. 8: a prefill's query row l
    equals the one-token decode at its position, bit for bit."""
    attention.require("bitwise_batch")
    case = _case(layout, attention)
    out = case.run(attention)
    b = data.draw(st.integers(0, len(layout["context_lens"]) - 1), label="request alone")
    alone = case.with_(query=case.query[b:b + 1], block_table=case.block_table[b:b + 1],
                       context_lens=case.context_lens[b:b + 1])
    assert bits(alone.run(attention)) == bits(out[b:b + 1])
    L = layout["query_len"]
    if L > 1:
        row = data.draw(st.sampled_from(sorted({0, L - 1, L // 2})), label="prefill row")
        decode = case.decode_row(row)
        assert bits(decode.run(attention)) == bits(out[:, :, row:row + 1])


class _Spy:
    """Stands in for the compiled module: any call into it is a computation."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda *a, **k: self.calls.append(name)


@pytest.mark.parametrize("kind", [pytest.param(k, marks=[pytest.mark.clause("inv10", f"reject.{REJECTIONS[k]}"),
                                                         declared(k)])
                                  for k in sorted(REJECTIONS)])
@settings(max_examples=settings.default.max_examples)
@given(data=st.data())
def test_rejected_metadata_raises_before_computing(kind, data, attention):
    """Each kind of rejected metadata raises (the built-in: its clause, and the compiled
    kernel is never called); the inputs keep their bits."""
    attention.require("validates_input")
    case = _case(data.draw(layouts(CAPS, kind), label="layout"), attention)
    assert kind in applicable(case), "layouts(caps, kind) drew a layout the kind cannot break"
    bad = data.draw(corruptions(case, kind), label="corruption")
    broken = bad.apply(case)
    before = [bits(a) for a in (case.key_pages, case.value_pages, case.query)]
    if attention.builtin:
        spy = _Spy()
        with mock.patch.object(impl.attention, "_kernels", spy):
            with pytest.raises(impl.ContractViolation) as info:
                broken.run(attention.fn)
        assert info.value.clause == bad.clause, info.value
        assert spy.calls == [], f"the kernel was called ({spy.calls}) on rejected input"
    else:
        with pytest.raises(attention.caps.error_types):
            broken.run(attention.fn)
    assert [bits(a) for a in (broken.key_pages, broken.value_pages, broken.query)] == before


@pytest.mark.clause("inv9")
@declared()
@examples
@given(layout=layouts(CAPS), data=st.data())
def test_unread_table_entries_are_neither_checked_nor_read(layout, data, attention):
    case = _case(layout, attention)
    table, lens = np.array(case.block_table), np.array(case.context_lens)
    need = -(-lens // case.page_size)
    unread = np.arange(table.shape[1])[None, :] >= need[:, None]
    if not unread.any():
        return
    garbage = data.draw(st.lists(st.integers(-2 ** 31, 2 ** 31 - 1), min_size=int(unread.sum()),
                                 max_size=int(unread.sum())), label="unread entries")
    table[unread] = garbage
    scrambled = case.with_(block_table=mx.array(table))
    assert_same_output(attention, scrambled.run(attention), case.run(attention), case,
                       "garbage in unread table entries")
