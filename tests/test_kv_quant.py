"""Quantized KV pages (REFERENCE.md 1b, contract/kv_format.py) in the kernel: the bitwise
invariants 6-9 with fp8 / int8 pages, the score pipeline on top of them, and the
rejections of the KV options.

| what must hold                                                            | test                                   |
|---------------------------------------------------------------------------|----------------------------------------|
| every code of every format decodes exactly, vector and scalar loads, both schedules | test_every_code_decodes_exactly |
| every format and granularity (K's and V's apart), with the whole v2 pipeline, meets the oracles | test_quantized_pipeline_meets_the_oracles |
| a request's bits do not depend on its batch (invariant 6)                 | test_invariant_6_quantized             |
| nor on the worker count (invariant 7)                                     | test_invariant_7_quantized             |
| every prefill row equals its decode across chunk edges (invariant 8)      | test_invariant_8_quantized             |
| NaN codes (int8: -128 and a NaN token scale) in unused slots change no bit (invariant 9) | test_invariant_9_quantized |
| a negative score scale times a K scale: the sign is applied once          | test_negative_scale_quantized          |
| bf16 queries on fp8 pages take the FMA path whatever the tile switch      | test_quantized_pools_leave_the_tiles   |
| bad KV options raise their clause before anything runs                    | test_kv_rejections                     |
"""

import mlx.core as mx
import numpy as np
import pytest

import impl
import pagecheck_kernels
from contract import KV_DTYPES
from fixtures import paged_case
from fixtures.quantized import code_values, quantized
from impl.errors import ContractViolation
from oracles.compare import compare
from tests.bitwise import bits_over_worker_counts, result_bits
from tests.tile_path import same_bits_either_way

pytestmark = pytest.mark.correctness

CHUNK = pagecheck_kernels.CHUNK
HQ, HKV = 8, 2
FORMATS = tuple(KV_DTYPES)
# (K's granularity, V's): each alone, and mixed pairs so a kernel that reads V's scale
# with K's rule shows it.
GRANULARITIES = [("tensor", "tensor"), ("head", "head"), ("token", "token"), ("token", "head"),
                 ("head", "tensor")]


def _pipeline(case, seed: int):
    """Soft-cap, ALiBi, sinks and the lse on top of the case (test_score_pipeline's values)."""
    rng = np.random.default_rng(seed)
    Hq = case.query.shape[1]
    return case.with_(softcap=1.5, alibi_slopes=mx.array(rng.uniform(0.01, 0.25, Hq).astype(np.float32)),
                      sinks=mx.array(rng.uniform(-1.0, 3.0, Hq).astype(np.float32)), return_lse=True)


@pytest.mark.clause("kv_format")
@pytest.mark.parametrize("head_dim", [16, 8])  # whole 16-lane loads; the scalar loads of a short row
@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_every_code_decodes_exactly(kv_dtype, head_dim, attention):
    """Value page rows hold the 256 codes in order; a causal window of 1 makes query row l
    see key l alone, so its output is that key's value row, decode(code), exactly (one
    key: weight 1, denominator 1). NaN codes give NaN, and so do only they. (-0 comes out
    +0: the weighted sum starts from +0, so the sign of a zero is not observable.)"""
    n = 256 // head_dim
    keys = np.zeros((1, 1, n, head_dim), dtype=np.uint8)
    codes = np.arange(256, dtype=np.uint8).reshape(1, 1, n, head_dim)
    if kv_dtype == "int8":
        keys, codes = keys.view(np.int8), codes.view(np.int8)
    case = paged_case(context_lens=[n], query_len=n, q_heads=1, kv_heads=1, head_dim=head_dim, page_size=n,
                      extra_pages=0, window=1).with_(key_pages=mx.array(keys), value_pages=mx.array(codes),
                                                     kv_dtype=kv_dtype, block_table=mx.array([[0]], dtype=mx.int32))
    attention.require_case(case)
    want = code_values(kv_dtype).reshape(n, head_dim)
    for schedule, out in (("prefill", case.run(attention)),
                          ("decode", mx.concatenate([case.decode_row(l).run(attention) for l in range(n)], axis=2))):
        got = np.array(out, dtype=np.float64)[0, 0]
        assert np.array_equal(np.isnan(got), np.isnan(want)), schedule
        assert np.array_equal(got, want, equal_nan=True), f"{schedule}: codes {np.flatnonzero(got != want)[:8]}"


@pytest.mark.clause("kv_format", "softcap", "alibi", "sinks", "lse")
@pytest.mark.parametrize("L", [1, 12])
@pytest.mark.parametrize("k,v", GRANULARITIES)
@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_quantized_pipeline_meets_the_oracles(kv_dtype, k, v, L, attention):
    base = paged_case(context_lens=[CHUNK + 40, 0, L + 5], query_len=L, q_heads=HQ, kv_heads=HKV, head_dim=32,
                      page_size=16, window=100, seed=L)
    case = _pipeline(quantized(base, kv_dtype, k=k, v=v), seed=L)
    attention.require_case(case)
    result = compare(case.run(attention), case.args(), case.kwargs())
    assert not result.failures(), result.failures()


@pytest.mark.clause("inv6", "kv_format")
@pytest.mark.parametrize("L", [1, 20])
@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_invariant_6_quantized(kv_dtype, L, attention):
    attention.require("bitwise_batch")
    big = quantized(paged_case(context_lens=[300, L, 0, 700], query_len=L, q_heads=HQ, kv_heads=HKV, head_dim=64,
                               page_size=16, window=200, seed=60 + L), kv_dtype, k="token", v="head")
    attention.require_case(big)
    out = big.run(attention)
    for b in range(4):
        alone = big.with_(query=big.query[b:b + 1], block_table=big.block_table[b:b + 1],
                          context_lens=big.context_lens[b:b + 1])
        assert result_bits(alone.run(attention)) == result_bits(out[b:b + 1]), f"request {b}"


@pytest.mark.clause("inv7", "kv_format")
@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_invariant_7_quantized(kv_dtype, attention):
    attention.require("bitwise_threads")
    case = quantized(paged_case(context_lens=[1100, 14, 513], query_len=7, q_heads=HQ, kv_heads=HKV, head_dim=64,
                                page_size=16, window=300, dtype="bfloat16", seed=70), kv_dtype, k="token")
    attention.require_case(case)
    seen = bits_over_worker_counts(case, attention)
    assert len(seen) == 1, f"{len(seen)} different outputs over worker counts"


@pytest.mark.clause("inv8", "kv_format")
@pytest.mark.parametrize("kv_dtype,k,v,dtype", [("float8_e4m3fn", "tensor", "tensor", "float32"),
                                                ("float8_e5m2", "head", "token", "float16"),
                                                ("int8", "token", "token", "bfloat16"),
                                                ("float8_e4m3fn", "token", "head", "bfloat16")])
def test_invariant_8_quantized(kv_dtype, k, v, dtype, attention):
    """Every prefill row equals the one-token decode at its position: both schedules
    decode the codes and apply each scale at the same step (attend_chunk)."""
    attention.require("bitwise_batch")
    n, before = 2 * CHUNK + 20, 37
    prefill = quantized(paged_case(context_lens=[before + n, 0], query_len=n, q_heads=4, kv_heads=2, head_dim=64,
                                   page_size=16, dtype=dtype, seed=80), kv_dtype, k=k, v=v)
    attention.require_case(prefill)
    out = prefill.run(attention)
    for p in (before, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK, before + n - 1):
        l = p - before
        assert result_bits(prefill.decode_row(l).run(attention)) == result_bits(out[:, :, l:l + 1]), f"row {l} (position {p})"


@pytest.mark.clause("inv9", "kv_format")
@pytest.mark.parametrize("L", [1, 12])
@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_invariant_9_quantized(kv_dtype, L, attention):
    """Unwritten slots and free pages hold the format's NaN code (int8: -128 with a NaN
    token scale) in one pool and zeros in the other: the same bits."""
    attention.require("bitwise_batch")
    kwargs = dict(context_lens=[45, 0, 17], query_len=L, q_heads=HQ, kv_heads=HKV, head_dim=32, page_size=8, seed=90)
    poisoned = quantized(paged_case(**kwargs), kv_dtype, k="token", v="token")
    clean = quantized(paged_case(**kwargs, fill=0.0), kv_dtype, k="token", v="token")
    assert not np.array_equal(np.array(poisoned.key_pages), np.array(clean.key_pages))  # the poison is there
    attention.require_case(poisoned)
    assert result_bits(poisoned.run(attention)) == result_bits(clean.run(attention))


@pytest.mark.clause("kv_format", "scale")
@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_negative_scale_quantized(kv_dtype, attention):
    case = quantized(paged_case(context_lens=[CHUNK + 9, 3], query_len=3, q_heads=HQ, kv_heads=HKV, head_dim=32,
                                page_size=16, scale=-0.3, seed=95), kv_dtype, k="head", v="token")
    attention.require_case(case)
    assert not compare(case.run(attention), case.args(), case.kwargs()).failures()


@pytest.mark.builtin_only("the built-in kernel's AMX tile path")
@pytest.mark.parametrize("L", [1, 40])
def test_quantized_pools_leave_the_tiles(L):
    """The tiles take bfloat16 pools only: fp8 pages run the FMA path (the same bits with
    the tiles on or off) and still meet the oracles."""
    case = quantized(paged_case(context_lens=[CHUNK + 30, L], query_len=L, q_heads=HQ, kv_heads=HKV, head_dim=64,
                                page_size=16, dtype="bfloat16", seed=100 + L), "float8_e4m3fn", k="token")
    on = same_bits_either_way(case)
    assert not compare(on, case.args(), case.kwargs()).failures()


def _base():
    return quantized(paged_case(context_lens=[20, 5], query_len=2, q_heads=4, kv_heads=2, head_dim=16, page_size=4,
                                seed=7), "float8_e4m3fn", k="token", v="head")


def _bad_inputs():
    """(label, changes to the base case, clause)."""
    P, Hkv, ps = _base().key_pages.shape[:3]
    return [
        ("unknown format", dict(kv_dtype="float8_e4m3"), "kv_dtype"),
        ("format not a string", dict(kv_dtype=8), "kv_dtype"),
        ("fp8 pages as int8", dict(key_pages=_base().key_pages.view(mx.int8)), "kv_dtype"),
        ("int8 format on uint8 pages", dict(kv_dtype="int8"), "kv_dtype"),
        ("float pages with a format", dict(value_pages=mx.zeros(_base().value_pages.shape)), "kv_dtype"),
        ("scale of zero", dict(k_scale=0.0), "kv_scale"),
        ("negative scale", dict(v_scale=-1.0), "kv_scale"),
        ("infinite scale", dict(k_scale=float("inf")), "kv_scale"),
        ("scale a bool", dict(k_scale=True), "kv_scale"),
        ("scale a string", dict(k_scale="1.0"), "kv_scale"),
        ("float16 scale array", dict(k_scale=mx.ones((Hkv,), dtype=mx.float16)), "kv_scale"),
        ("[Hq] scale", dict(k_scale=mx.ones((4,))), "kv_scale"),
        ("[1] scale with Hkv 2", dict(v_scale=mx.ones((1,))), "kv_scale"),
        ("[P, Hkv] scale", dict(v_scale=mx.ones((P, Hkv))), "kv_scale"),
        ("token scale of another page size", dict(k_scale=mx.ones((P, Hkv, ps + 1))), "kv_scale"),
        ("float64 numpy scale", dict(k_scale=np.ones((Hkv,))), "kv_scale"),
    ]


@pytest.mark.builtin_only("the built-in's rejection clauses (impl/errors.py)")
@pytest.mark.clause("inv10", "kv_format")
@pytest.mark.parametrize("label,changes,clause", _bad_inputs(), ids=[b[0] for b in _bad_inputs()])
def test_kv_rejections(label, changes, clause):
    case = _base().with_(**changes)
    with pytest.raises(ContractViolation) as err:
        case.run(impl.paged_attention)
    assert err.value.clause == clause, f"{label}: {err.value}"


@pytest.mark.builtin_only("the built-in's rejection clauses (impl/errors.py)")
@pytest.mark.parametrize("name", ["k_scale", "v_scale"])
def test_scale_without_format_is_rejected(name):
    case = paged_case(context_lens=[5], query_len=1, q_heads=4, kv_heads=2, head_dim=16, page_size=4)
    with pytest.raises(ContractViolation) as err:
        case.with_(**{name: 2.0}).run(impl.paged_attention)
    assert err.value.clause == "kv_scale"
