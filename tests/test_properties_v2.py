"""Property tests of contract v2 (REFERENCE.md 1b) on random paged layouts.

Each example is a `layouts(caps)` layout (fixtures/strategies.py: random shapes, page
ids, NaN in every free page and tail slot, empty rows) with a random score pipeline on
top: a soft-cap from 0.3 to 50 (from bending every score to leaving most alone), ALiBi
slopes, sinks from far below to far above the scores, the lse, and value pages of
another head dim. Only the features the implementation declares are drawn, so a kernel
without sinks never meets one. The output and lse must meet the tolerance rule against
the oracles (oracles.compare), and every prefill row must equal its one-token decode,
out and lse, bit for bit (invariant 8) where the implementation declares bitwise_batch.
"""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st

from conformance.plugin import current
from fixtures import bits, paged_case
from fixtures.strategies import layouts
from oracles.compare import compare

pytestmark = pytest.mark.correctness

examples = settings(max_examples=2 * settings.default.max_examples)
UNDER_TEST = current()
CAPS = UNDER_TEST.caps if UNDER_TEST is not None else None
FEATURES = ("softcap", "alibi", "sinks", "lse", "value_head_dim")


def _declared() -> tuple[str, ...]:
    return tuple(f for f in FEATURES if CAPS is None or getattr(CAPS, f, False))


def _skip_unless_some_feature():
    if _declared():
        return pytest.mark.skipif(False, reason="")
    name = UNDER_TEST.name if UNDER_TEST is not None else "the implementation"
    return pytest.mark.skipif(True, reason=f"not declared by {name}: any of {', '.join(FEATURES)}")


@st.composite
def pipelines(draw, q_heads: int, head_dim: int):
    """Keyword changes of a Case: the declared v2 features, each on or off."""
    on = draw(st.sets(st.sampled_from(_declared()), min_size=1))
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
    changes = {"return_lse": "lse" in on}
    if "softcap" in on:
        changes["softcap"] = draw(st.sampled_from([0.3, 1.0, 4.0, 50.0]))
    if "alibi" in on:
        changes["alibi_slopes"] = mx.array(rng.uniform(0.0, 0.5, q_heads).astype(np.float32))
    if "sinks" in on:
        changes["sinks"] = mx.array(rng.uniform(-30.0, 30.0, q_heads).astype(np.float32))
    if "value_head_dim" in on:
        changes["value_dim"] = draw(st.sampled_from([d for d in (1, 8, 24, 64) if d != head_dim]))
    return changes


def _with_values(case, value_dim: int, seed: int):
    P, Hkv, ps, _ = case.value_pages.shape
    values = np.random.default_rng(seed).standard_normal((P, Hkv, ps, value_dim)).astype(np.float32)
    old = np.array(case.value_pages.astype(mx.float32))
    values[np.isnan(old[..., :1]).repeat(value_dim, axis=-1)] = np.nan  # unread slots stay NaN
    return case.with_(value_pages=mx.array(values).astype(case.dtype))


@st.composite
def v2_cases(draw):
    layout = draw(layouts(CAPS))
    changes = draw(pipelines(layout.get("q_heads", 4), layout.get("head_dim", 16)))
    value_dim = changes.pop("value_dim", None)
    case = paged_case(**layout).with_(**changes)
    if value_dim is not None:
        case = _with_values(case, value_dim, seed=draw(st.integers(0, 1000)))
    note(f"pipeline: {case.pipeline.describe()}, Dv {case.value_pages.shape[-1]}")
    return case


@pytest.mark.clause("softcap", "alibi", "sinks", "lse", "value_dim")
@_skip_unless_some_feature()
@examples
@given(case=v2_cases())
def test_pipeline_matches_the_oracles(case, attention):
    result = compare(case.run(attention), case.args(), case.kwargs())
    assert not result.failures(), result.failures()


@pytest.mark.clause("inv8", "sinks", "alibi")
@_skip_unless_some_feature()
@examples
@given(case=v2_cases())
def test_pipeline_prefill_rows_equal_their_decode(case, attention):
    attention.require("bitwise_batch")
    L = case.query.shape[2]
    if L == 1 or case.mask is None:
        return  # a decode already; unmasked rows move to ctx - 1 (fixtures/case.py decode_row)
    out = case.run(attention)
    out, lse = out if isinstance(out, tuple) else (out, None)
    for l in sorted({0, L // 2, L - 1}):
        got = case.decode_row(l).run(attention)
        got, got_lse = got if isinstance(got, tuple) else (got, None)
        assert bits(got) == bits(out[:, :, l:l + 1]), f"row {l}"
        if lse is not None:
            assert bits(got_lse) == bits(lse[:, :, l:l + 1]), f"row {l}: lse"
