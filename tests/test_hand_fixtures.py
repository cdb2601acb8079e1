"""The hand-fixture catalog (fixtures/data/*.json): the kernel against answers derived by hand.

Each fixture names the bug it catches and carries its derivation. The kernel must keep
dtype and shape, produce no NaN, and meet the tolerance rule against the hand answer
(bit equality too where the derivation shows the float result is exact). The hand
answers themselves are checked against the float64 oracle, and the catalog against its
required contents. A fixture that would not fit in the memory free now, for this
implementation (its declared `extra_memory`), is skipped with both numbers before it
is built: the 2^31-offset fixture's 4 GiB pool widened to float64 would get the whole
run killed.
"""

import mlx.core as mx
import numpy as np
import pytest

import oracles
from conformance.clauses import CLAUSES
from fixtures import DTYPES, bits, hand_case, hand_names, to_numpy
from fixtures.hand import hand_fixtures, hand_info, hand_spec
from fixtures.memory import GiB, need_bytes, pool_bytes, shortfall
from oracles.compare import value_scale
from oracles.tolerance import Verdict, allowed_error, max_abs_error, ref_scale

pytestmark = pytest.mark.correctness

REQUIRED = (
    "course_hand_example", "context_inside_one_page", "tile_crossing_page_boundary",
    "reversed_and_non_consecutive_pages", "l65_context_not_tile_multiple",
    "causal_decode_after_paged_prefill", "gqa_6_to_2", "gqa_32_to_8", "bf16_output_dtype_preserved",
    "batch_with_empty_row", "window_family", "shared_prefix_pages", "extreme_logits", "page_size_1",
    "page_size_256", "page_offset_past_2_31",
)


def _params(*, skip_slow=False):
    for name in hand_names():
        info = hand_info(name)
        if info.slow and skip_slow:
            continue
        marks = [pytest.mark.clause(info.clause)] if info.clause in CLAUSES else []
        yield pytest.param(name, marks=marks + ([pytest.mark.slow] if info.slow else []), id=name)


def _read_value_scale(case) -> float:
    """max |V| over the pages the requests read (the rest is NaN): no pool-sized copy."""
    table, lens = np.array(case.block_table), np.array(case.context_lens)
    pages = sorted({int(p) for b, ctx in enumerate(lens) for p in table[b, :-(-int(ctx) // case.page_size)]})
    return value_scale(case.value_pages[mx.array(pages)]) if pages else 1.0


# MLX and NumPy temporaries, the query and expected arrays, the checker's gather of the
# pages read: small for every fixture in the catalog
HOST_MARGIN = 256 * 2 ** 20


def _loader_bytes(spec: dict) -> int:
    """The loader's float64 host copies (fixtures/hand.py): each written page once per
    pool dict and each request's keys and values, beside the margin."""
    ps, Hkv, D = spec["page_size"], spec["kv_heads"], spec["head_dim"]
    lens = [r["context_len"] for r in spec["requests"]]
    pages = sum(-(-ctx // ps) for ctx in lens)
    return 8 * 2 * Hkv * D * (pages * ps + sum(lens)) + HOST_MARGIN


def _skip_unless_it_fits(name: str, attention) -> None:
    """Skips `name` where its pools, what the implementation may allocate beside them
    and the loader's own arrays exceed the memory free now; computed from the spec,
    before any pool is built."""
    spec = hand_spec(name)
    geometry = {k: spec[k] for k in ("num_pages", "kv_heads", "page_size", "head_dim", "dtype")}
    built = pool_bytes(**geometry, pools=1 if spec.get("values_alias_keys") else 2)
    inputs = pool_bytes(**geometry)  # keys and values, aliased or not
    extra, working = attention.caps.extra_memory, _loader_bytes(spec)
    reason = shortfall(need_bytes(built=built, inputs=inputs, extra_memory=extra, working_set=working))
    if reason:
        pytest.skip(f"does not fit in memory for {attention.name}: {reason} (pools {built / GiB:.1f} GiB, "
                    f"extra_memory {extra:g} x {inputs / GiB:.1f} GiB of pool inputs, "
                    f"{working / GiB:.1f} GiB loader working set)")


@pytest.mark.parametrize("name", list(_params()))
def test_hand_fixture(name, attention, error_log):
    """Each hand fixture: the implementation against the answer derived by hand."""
    _skip_unless_it_fits(name, attention)
    info, case = hand_info(name), hand_case(name)
    out = case.run(attention)
    assert out.dtype == DTYPES[hand_spec(name)["dtype"]] == case.dtype, f"{name}: output dtype {out.dtype}"
    assert out.shape == case.query.shape
    assert not np.isnan(to_numpy(out)).any(), f"{name} ({info.catches}): NaN in the output"
    # The huge fixture skips the SDPA oracle (it would gather a 4 GiB pool): sdpa_error = 0,
    # and its derivation is exact, so bit equality below is the stronger check anyway.
    sdpa_error = 0.0 if info.slow else max_abs_error(case.run(oracles.MLX_ORACLES["sdpa"]), case.expected)
    allowed = allowed_error(case.dtype, case.expected, sdpa_error, _read_value_scale(case))
    verdict = Verdict(max_abs_error(out, case.expected), allowed, ref_scale(case.expected))
    error_log.record(case.dtype, "hand", verdict)
    assert verdict.ok, f"{name} ({info.catches}): {verdict}"
    if info.exact:
        want = mx.array(case.expected.astype(np.float32)).astype(case.dtype)
        assert bits(out) == bits(want), (
            f"{name} is exact by its derivation but differs in bits: max error {verdict.error:.3e}")


@pytest.mark.parametrize("name", list(_params(skip_slow=True)))
def test_hand_answer_matches_float64_oracle(name):
    """The hand derivations, checked: each expected output against the float64 oracle on the
    same (dtype-cast) inputs, under the tolerance rule with no SDPA term."""
    case = hand_case(name)
    ref = case.run(oracles.float64)
    verdict = Verdict(max_abs_error(case.expected, ref),
                      allowed_error(case.dtype, ref, 0.0, _read_value_scale(case)))
    assert verdict.ok, f"{name}: hand answer vs float64 oracle: {verdict}"


def test_catalog_is_complete():
    stems = hand_fixtures()
    assert len(stems) >= 16, stems
    missing = sorted(set(REQUIRED) - set(stems))
    assert not missing, f"missing fixtures: {missing}"
    for name in hand_names():
        info = hand_info(name)
        assert info.catches.strip(), f"{name}: empty 'catches'"
        assert info.derivation and all(line.strip() for line in info.derivation), f"{name}: empty 'derivation'"
        assert hand_spec(name)["name"] == info.fixture, f"{name}: 'name' differs from the file name"
        assert info.clause in CLAUSES, f"{name}: clause {info.clause!r} is not in conformance/clauses.py"
