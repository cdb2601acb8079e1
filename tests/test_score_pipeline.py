"""Contract v2's score pipeline (REFERENCE.md 1b: soft-cap, ALiBi, sinks, lse, Dv != Dk)
against the oracles and under the bitwise invariants 6-9, every feature on.

| what must hold                                                        | test                                   |
|-----------------------------------------------------------------------|----------------------------------------|
| each feature alone and all together meet the tolerance rule (out, lse) | test_features_meet_the_oracles         |
| a request's bits do not depend on its batch (invariant 6)             | test_invariant_6_with_every_feature    |
| nor on the worker count (invariant 7)                                 | test_invariant_7_with_every_feature    |
| every prefill row equals its decode, across chunk edges (invariant 8) | test_invariant_8_with_every_feature    |
| unused slots change no bit (invariant 9)                              | test_invariant_9_with_every_feature    |
| the tiles run the pipeline (bits differ from the FMAs, both correct)  | test_tiles_run_the_pipeline            |
| Dv != Dk falls back from the tiles to the FMA path, bit for bit       | test_value_dim_falls_back_from_tiles   |
| the raw-score lse and the logit-mode lse agree                        | test_lse_agrees_across_score_modes     |
"""

import mlx.core as mx
import numpy as np
import pytest

import impl
import pagecheck_kernels
from fixtures import paged_case
from oracles.compare import compare
from tests.bitwise import bits_over_worker_counts, result_bits
from tests.tile_path import same_bits_either_way, tile_path

pytestmark = pytest.mark.correctness

CHUNK = pagecheck_kernels.CHUNK
HQ, HKV = 8, 2


def _vectors(seed: int) -> tuple[mx.array, mx.array]:
    """ALiBi slopes and sinks of visible size for HQ heads (sinks near the scores' range)."""
    rng = np.random.default_rng(seed)
    slopes = rng.uniform(0.01, 0.25, HQ).astype(np.float32)
    sinks = rng.uniform(-1.0, 3.0, HQ).astype(np.float32)
    return mx.array(slopes), mx.array(sinks)


def _with(case, features: str, seed: int = 0, value_dim: int | None = None):
    """The case with the named features on ("softcap+alibi+sinks+lse+dv"), lse always."""
    slopes, sinks = _vectors(seed)
    changes = {"return_lse": True}
    if "softcap" in features:
        changes["softcap"] = 1.5  # random scores reach |s| ~ 3: the cap bends them
    if "alibi" in features:
        changes["alibi_slopes"] = slopes
    if "sinks" in features:
        changes["sinks"] = sinks
    if value_dim is not None:
        rng = np.random.default_rng(seed + 1)
        P, Hkv, ps, _ = case.value_pages.shape
        values = rng.standard_normal((P, Hkv, ps, value_dim)).astype(np.float32)
        changes["value_pages"] = mx.array(values).astype(case.dtype)
    return case.with_(**changes)


ALL = "softcap+alibi+sinks"


def _row(result, rows):
    out, lse = result
    return out[:, :, rows], lse[:, :, rows]


@pytest.mark.clause("softcap", "alibi", "sinks", "lse", "value_dim")
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("L", [1, 3, 12])
@pytest.mark.parametrize("features", ["softcap", "alibi", "sinks", "lse", ALL, ALL + "+dv", "dv"])
def test_features_meet_the_oracles(features, L, dtype, attention, error_log):
    base = paged_case(context_lens=[CHUNK + 40, 0, L + 5], query_len=L, q_heads=HQ, kv_heads=HKV, head_dim=32,
                      page_size=16, dtype=dtype, window=100 if "alibi" in features else None, seed=L)
    case = _with(base, features, seed=L, value_dim=48 if "dv" in features else None)
    attention.require_case(case)
    result = compare(case.run(attention), case.args(), case.kwargs())
    error_log.record(case.dtype, "float64", result.against_float64)
    assert not result.failures(), result.failures()


@pytest.mark.clause("inv6")
@pytest.mark.parametrize("L", [1, 20])
def test_invariant_6_with_every_feature(L, attention):
    attention.require("bitwise_batch")
    big = _with(paged_case(context_lens=[300, L, 0, 700], query_len=L, q_heads=HQ, kv_heads=HKV, head_dim=64,
                           page_size=16, window=200, seed=60 + L), ALL)
    attention.require_case(big)
    out = big.run(attention)
    for b in range(4):
        alone = big.with_(query=big.query[b:b + 1], block_table=big.block_table[b:b + 1],
                          context_lens=big.context_lens[b:b + 1])
        assert result_bits(alone.run(attention)) == result_bits((out[0][b:b + 1], out[1][b:b + 1])), f"request {b}"


@pytest.mark.clause("inv7")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_invariant_7_with_every_feature(dtype, attention):
    attention.require("bitwise_threads")
    case = _with(paged_case(context_lens=[1100, 14, 513], query_len=7, q_heads=HQ, kv_heads=HKV, head_dim=64,
                            page_size=16, window=300, dtype=dtype, seed=70), ALL)
    attention.require_case(case)
    seen = bits_over_worker_counts(case, attention)
    assert len(seen) == 1, f"{len(seen)} different (output, lse) over worker counts"


@pytest.mark.clause("inv8", "sinks")
@pytest.mark.parametrize("dtype,window", [("float32", None), ("float32", 100), ("bfloat16", None),
                                          ("float16", 300)])
def test_invariant_8_with_every_feature(dtype, window, attention):
    """Every prefill row equals the one-token decode at its position (out and lse), across
    chunk edges: the sink is folded in once per row in both schedules, and the bias
    depends on the row's position, not on how the query was split."""
    attention.require("bitwise_batch")
    n, before = 2 * CHUNK + 20, 37  # the prefill's rows sit at positions 37 .. n + 36, not at l
    prefill = _with(paged_case(context_lens=[before + n, 0], query_len=n, q_heads=4, kv_heads=2, head_dim=64,
                               page_size=16, window=window, dtype=dtype, seed=80), ALL)
    prefill = prefill.with_(alibi_slopes=prefill.alibi_slopes[:4], sinks=prefill.sinks[:4])
    attention.require_case(prefill)
    out = prefill.run(attention)
    for p in (before, before + 1, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK, before + n - 1):
        l = p - before
        decode = prefill.decode_row(l)
        assert result_bits(decode.run(attention)) == result_bits(_row(out, slice(l, l + 1))), f"row {l} (position {p})"


@pytest.mark.clause("inv9")
@pytest.mark.parametrize("L", [1, 12])
def test_invariant_9_with_every_feature(L, attention):
    attention.require("bitwise_batch")
    kwargs = dict(context_lens=[45, 0, 17], query_len=L, q_heads=HQ, kv_heads=HKV, head_dim=32, page_size=8, seed=90)
    poisoned = _with(paged_case(**kwargs), ALL)  # NaN in every unwritten slot and free page
    attention.require_case(poisoned)
    clean = _with(paged_case(**kwargs, fill=0.0), ALL)
    assert result_bits(poisoned.run(attention)) == result_bits(clean.run(attention))


@pytest.mark.builtin_only("the built-in kernel's AMX tile path")
@pytest.mark.parametrize("L", [1, 8, 40])
def test_tiles_run_the_pipeline(L):
    """bfloat16 with every feature on: the tiles and the FMAs both meet the rule and their
    bits differ (so the tile path really ran the pipeline, not a fallback)."""
    case = _with(paged_case(context_lens=[CHUNK + 30, L], query_len=L, q_heads=HQ, kv_heads=HKV, head_dim=64,
                            page_size=16, window=120, dtype="bfloat16", seed=100 + L), ALL)
    results = {}
    for on in (True, False):
        with tile_path(on):
            results[on] = case.run(impl.paged_attention)
        assert not compare(results[on], case.args(), case.kwargs()).failures(), f"tiles {on}"
    assert result_bits(results[True]) != result_bits(results[False])


@pytest.mark.builtin_only("the built-in kernel's AMX tile path")
@pytest.mark.clause("value_dim")
@pytest.mark.parametrize("L", [1, 12])
def test_value_dim_falls_back_from_tiles(L):
    """The tiles pack V with the keys' head dim, so Dv != Dk takes the FMA path (amx.h:
    amx_applies): the same bits with the tiles switched on or off."""
    case = _with(paged_case(context_lens=[300, L], query_len=L, q_heads=HQ, kv_heads=HKV, head_dim=64,
                            page_size=16, dtype="bfloat16", seed=110 + L), ALL, value_dim=32)
    on = same_bits_either_way(case)
    assert not compare(on, case.args(), case.kwargs()).failures()


@pytest.mark.builtin_only("the built-in kernel's two score modes (numerics in kernel.h)")
@pytest.mark.clause("lse")
@pytest.mark.parametrize("scale", [None, -0.2])
def test_lse_agrees_across_score_modes(scale):
    """Without soft-cap, ALiBi and sinks the kernel keeps raw scores and reports
    lse = |scale| m + ln l; with a soft-cap too large to bend anything it works on logits.
    The two lse agree to float32 rounding, and an empty slot is -inf in both."""
    case = paged_case(context_lens=[CHUNK + 3, 0, 9], query_len=3, q_heads=HQ, kv_heads=HKV, head_dim=32,
                      page_size=16, scale=scale, seed=120).with_(return_lse=True)
    raw = np.array(case.run(impl.paged_attention)[1])
    logits = np.array(case.with_(softcap=1e30).run(impl.paged_attention)[1])
    assert np.array_equal(np.isneginf(raw), np.isneginf(logits)) and np.isneginf(raw[1]).all()
    live = np.isfinite(raw)
    assert live[[0, 2]].all()
    assert np.abs(raw[live] - logits[live]).max() <= 1e-5 * max(1.0, np.abs(raw[live]).max())
