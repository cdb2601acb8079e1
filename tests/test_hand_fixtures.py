"""The hand-fixture catalog (fixtures/data/*.json): the kernel against answers derived by hand.

Each fixture names the bug it catches and carries its derivation. The kernel must keep
dtype and shape (the output's head dim is the values' Dv), produce no NaN, and meet the
tolerance rule against the hand answer (bit equality too where the derivation shows the
float result is exact); with `return_lse` its lse (float32 `[B, Hq, L]`) meets the LSE
rule against the hand lse, -inf exactly at the empty slots. Where MLX SDPA cannot
express the call (soft-cap) the rule's a-priori E_na stands in for SDPA's error. The
hand answers themselves (outputs and lse) are checked against the float64 oracle, and
the catalog against its required contents. A fixture that would not fit in the memory free now, for this
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
from oracles.compare import call_logit_error, value_scale
from oracles.tolerance import (Verdict, allowed_error, allowed_error_unmeasured, allowed_lse_error, lse_error,
                               lse_scale, max_abs_error, ref_scale)

pytestmark = pytest.mark.correctness

REQUIRED = (
    "course_hand_example", "context_inside_one_page", "tile_crossing_page_boundary",
    "reversed_and_non_consecutive_pages", "l65_context_not_tile_multiple",
    "causal_decode_after_paged_prefill", "gqa_6_to_2", "gqa_32_to_8", "bf16_output_dtype_preserved",
    "batch_with_empty_row", "window_family", "shared_prefix_pages", "extreme_logits", "page_size_1",
    "page_size_256", "page_offset_past_2_31",
    # contract v2 (REFERENCE.md 1b)
    "softcap_saturated", "softcap_float16_overflow", "softcap_on_scaled_score", "softcap_alibi_sinks_lse",
    "sink_single_visible_key", "sink_window_past_first_chunk", "sink_once_per_row_multi_chunk", "sink_dominates",
    "alibi_decode_sign_offset", "alibi_prefill_offset", "alibi_window", "alibi_gqa_slopes",
    "lse_empty_row", "lse_equal_scores", "lse_with_sinks", "value_dim_8_to_4", "value_dim_mla_192_128",
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
    return 8 * Hkv * (D + spec.get("value_head_dim", D)) * (pages * ps + sum(lens)) + HOST_MARGIN


def _skip_unless_it_fits(name: str, attention) -> None:
    """Skips `name` where its pools, what the implementation may allocate beside them
    and the loader's own arrays exceed the memory free now; computed from the spec,
    before any pool is built."""
    spec = hand_spec(name)
    geometry = {k: spec[k] for k in ("num_pages", "kv_heads", "page_size", "dtype")}
    keys = pool_bytes(**geometry, head_dim=spec["head_dim"], pools=1)
    values = pool_bytes(**geometry, head_dim=spec.get("value_head_dim", spec["head_dim"]), pools=1)
    built = keys if spec.get("values_alias_keys") else keys + values
    inputs = keys + values  # keys and values, aliased or not
    extra, working = attention.caps.extra_memory, _loader_bytes(spec)
    reason = shortfall(need_bytes(built=built, inputs=inputs, extra_memory=extra, working_set=working))
    if reason:
        pytest.skip(f"does not fit in memory for {attention.name}: {reason} (pools {built / GiB:.1f} GiB, "
                    f"extra_memory {extra:g} x {inputs / GiB:.1f} GiB of pool inputs, "
                    f"{working / GiB:.1f} GiB loader working set)")


def _allowed(case, info) -> float:
    """The output's allowance against the hand answer: SDPA's error on the same inputs, or
    E_na where SDPA cannot express the call (oracles/tolerance.py). The huge fixture skips
    SDPA (it would gather a 4 GiB pool): its derivation is exact, bit equality is the check."""
    if info.slow:
        return allowed_error(case.dtype, case.expected, 0.0, _read_value_scale(case))
    try:
        sdpa = case.with_(return_lse=False).run(oracles.MLX_ORACLES["sdpa"])
    except oracles.NotApplicable:
        return allowed_error_unmeasured(case.dtype, case.expected, call_logit_error(case.args(), case.kwargs()),
                                        _read_value_scale(case))
    return allowed_error(case.dtype, case.expected, max_abs_error(sdpa, case.expected), _read_value_scale(case))


def _split(result, case):
    """(out, lse): lse None unless the call asked for it."""
    if not case.return_lse:
        return result, None
    assert isinstance(result, tuple) and len(result) == 2, f"{case.name}: return_lse must give (out, lse)"
    return result


@pytest.mark.parametrize("name", list(_params()))
def test_hand_fixture(name, attention, error_log):
    """Each hand fixture: the implementation against the answer derived by hand."""
    _skip_unless_it_fits(name, attention)
    info, case = hand_info(name), hand_case(name)
    out, lse = _split(case.run(attention), case)
    assert out.dtype == DTYPES[hand_spec(name)["dtype"]] == case.dtype, f"{name}: output dtype {out.dtype}"
    assert out.shape == case.query.shape[:3] + case.value_pages.shape[3:], f"{name}: output shape {out.shape}"
    assert not np.isnan(to_numpy(out)).any(), f"{name} ({info.catches}): NaN in the output"
    verdict = Verdict(max_abs_error(out, case.expected), _allowed(case, info), ref_scale(case.expected))
    error_log.record(case.dtype, "hand", verdict)
    assert verdict.ok, f"{name} ({info.catches}): {verdict}"
    if info.exact:
        want = mx.array(case.expected.astype(np.float32)).astype(case.dtype)
        assert bits(out) == bits(want), (
            f"{name} is exact by its derivation but differs in bits: max error {verdict.error:.3e}")
    if lse is not None:
        assert lse.dtype == mx.float32 and lse.shape == case.query.shape[:3], f"{name}: lse {lse.dtype} {lse.shape}"
        allowed = allowed_lse_error(case.expected_lse, call_logit_error(case.args(), case.kwargs()), case.dtype)
        lse_verdict = Verdict(lse_error(lse, case.expected_lse), allowed, lse_scale(case.expected_lse))
        assert lse_verdict.ok, f"{name} ({info.catches}): lse (-inf exactly at empty slots): {lse_verdict}"


@pytest.mark.parametrize("name", list(_params(skip_slow=True)))
def test_hand_answer_matches_float64_oracle(name):
    """The hand derivations, checked: each expected output (and lse) against the float64
    oracle on the same (dtype-cast) inputs, under the tolerance rule with no SDPA term
    (and the LSE rule with no logit error: the two differ only by the float32 rounding of
    the inputs, scalars included)."""
    case = hand_case(name)
    ref, ref_lse = _split(case.run(oracles.float64), case)
    verdict = Verdict(max_abs_error(case.expected, ref),
                      allowed_error(case.dtype, ref, 0.0, _read_value_scale(case)))
    assert verdict.ok, f"{name}: hand answer vs float64 oracle: {verdict}"
    if ref_lse is not None:
        lse_verdict = Verdict(lse_error(case.expected_lse, ref_lse), allowed_lse_error(ref_lse, 0.0))
        assert lse_verdict.ok, f"{name}: hand lse vs float64 oracle: {lse_verdict}"


def test_catalog_is_complete():
    stems = hand_fixtures()
    assert len(stems) >= len(REQUIRED), stems
    missing = sorted(set(REQUIRED) - set(stems))
    assert not missing, f"missing fixtures: {missing}"
    for name in hand_names():
        info = hand_info(name)
        assert info.catches.strip(), f"{name}: empty 'catches'"
        assert info.derivation and all(line.strip() for line in info.derivation), f"{name}: empty 'derivation'"
        assert hand_spec(name)["name"] == info.fixture, f"{name}: 'name' differs from the file name"
        assert info.clause in CLAUSES, f"{name}: clause {info.clause!r} is not in conformance/clauses.py"
