"""Quantized KV pages (REFERENCE.md 1b, contract/kv_format.py) through the implementation
under test (`attention`: the built-in, or any `--impl` kernel declaring `kv_dtypes` /
`kv_scales`), judged by the four oracles on the dequantized pages.

Every case is a generated float case (fixtures.paged_case: scrambled pages, free pages,
NaN in every unread slot) quantized by fixtures.quantized (head scales 2^(g+1) apart,
per-token scales one per physical slot, unread slots poisoned), GQA with G = 3.

| check                                   | what must hold                                                   | clauses |
|-----------------------------------------|------------------------------------------------------------------|---------|
| test_quantized_call_meets_the_oracles   | each format x (K, V) scale granularity (mixed pairs, a Python float, a missing scale) x query dtype x shape (decode / prefill, page size 1 / 16, windows) within the tolerance rule | kv_format |
| test_quantized_with_the_score_pipeline  | each format under soft-cap, ALiBi, sinks and the returned lse together (out and lse within their rules) | kv_format, softcap, alibi, sinks, lse |
| test_page_order_moves_codes_and_scales  | a decode over complete pages is invariant to renaming the pages when codes and per-token scales move together | kv_format, inv2 |
| test_unread_slots_change_nothing        | other garbage (codes, per-token scales) in free pages and unused slots changes nothing | kv_format, inv9 |
| test_batch_independent_bits             | `bitwise_batch`: a request's bits alone equal its bits in the batch | kv_format, inv6 |
| test_prefill_rows_equal_their_decodes   | `bitwise_batch`: each prefill row's bits equal the one-token decode at its position | kv_format, inv8 |

A format, granularity or query dtype the implementation does not declare is skipped with
the reason (conformance/capabilities.py: `KV format F (declare kv_dtypes=[..., 'F'] ...)`),
never failed. Each measured check records, for the report, the kernel's error beside the
error the quantization itself adds against the float case it came from
(`oracles.quantization_error`): the first is judged, the second only reported.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from conformance.implementation import assert_same_output
from contract import KV_DTYPES
from fixtures import bits, paged_case, to_numpy
from fixtures.quantized import encode, quantized
from oracles import quantization_error
from oracles.compare import compare

pytestmark = [pytest.mark.correctness, pytest.mark.clause("kv_format")]

HQ, HKV, D = 6, 2, 16  # G = 3: the query head h % Hkv and the KV head h // G differ for h = 1, 2, 3, 5
FORMATS = tuple(KV_DTYPES)
# (K's scale, V's scale): the three granularities, two mixed pairs, a Python float and a missing one (1.0)
SCALES = [("tensor", "tensor"), ("head", "head"), ("token", "token"), ("tensor", "token"), ("token", "head"),
          ("float", "none")]
# name -> (query_len, page_size, window, context_lens): decode and prefill, page sizes 1 and 16, windows
SHAPES = {
    "decode-ps16": (1, 16, None, [37, 0, 16, 5]),
    "prefill-ps1": (6, 1, None, [19, 0, 6]),
    "decode-ps1-window5": (1, 1, 5, [23, 9, 0]),
    "prefill-ps16-window7": (5, 16, 7, [40, 5, 0, 18]),
}


def _quantize(base, kv_dtype: str, k: str, v: str):
    """`base` with its pages quantized: fixtures' granularities, or K's tensor scale as a
    Python float (`float`) and V's scale left out (`none`: a missing scale is 1.0, so the V
    codes are V's values rounded at scale 1)."""
    if (k, v) != ("float", "none"):
        return quantized(base, kv_dtype, k=k, v=v)
    case = quantized(base, kv_dtype, k="tensor")
    values = mx.array(encode(to_numpy(base.value_pages).astype(np.float64), kv_dtype))
    return case.with_(k_scale=float(np.array(case.k_scale)), value_pages=values, v_scale=None,
                      name=f"{case.name}-float/none")


def _case(kv_dtype: str, k: str, v: str, dtype: str, shape: str, seed: int = 0):
    L, ps, window, lens = SHAPES[shape]
    base = paged_case(context_lens=lens, query_len=L, q_heads=HQ, kv_heads=HKV, head_dim=D, page_size=ps,
                      dtype=dtype, window=window, seed=seed)
    return base, _quantize(base, kv_dtype, k, v)


def _judge(attention, error_log, case, base) -> None:
    """The call against the oracles; records the kernel's error and the quantization's."""
    result = compare(case.run(attention), case.args(), case.kwargs())
    error_log.record(case.dtype, "float64", result.against_float64)
    error_log.record_kv(case.kv_dtype, result.against_float64,
                        quantization_error(case.args(), case.kwargs(), base.key_pages, base.value_pages))
    assert not result.failures(), f"{case.name}: {result.failures()}"


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("k,v", SCALES, ids=[f"{k}-{v}" for k, v in SCALES])
@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_quantized_call_meets_the_oracles(kv_dtype, k, v, dtype, shape, attention, error_log):
    base, case = _case(kv_dtype, k, v, dtype, shape, seed=list(SHAPES).index(shape))
    attention.require_case(case)
    _judge(attention, error_log, case, base)


@pytest.mark.clause("softcap", "alibi", "sinks", "lse")
@pytest.mark.parametrize("L", [1, 7])
@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_quantized_with_the_score_pipeline(kv_dtype, L, attention, error_log):
    """Quantized pages under every contract-v2 score feature at once: the dequantized
    scores are capped, biased and normalized with the sink as section 1b says."""
    base = paged_case(context_lens=[41, 0, L + 6], query_len=L, q_heads=HQ, kv_heads=HKV, head_dim=D,
                      page_size=16, dtype="bfloat16", window=30, seed=61 + L)
    rng = np.random.default_rng(L)
    base = base.with_(softcap=1.5, alibi_slopes=mx.array(rng.uniform(0.01, 0.25, HQ).astype(np.float32)),
                      sinks=mx.array(rng.uniform(-1.0, 3.0, HQ).astype(np.float32)), return_lse=True)
    case = quantized(base, kv_dtype, k="head", v="token")
    attention.require_case(case)
    _judge(attention, error_log, case, base)


def _renamed(case, perm: np.ndarray):
    """The same call with physical page p moved to perm[p]: codes and per-token scales
    move with their page, the table names the new places."""
    inverse = np.argsort(perm)
    move = lambda x: x[mx.array(inverse)]  # noqa: E731 - new page q holds old page inverse[q]
    table = np.array(case.block_table)
    table = np.where(table >= 0, perm[np.maximum(table, 0)], -1).astype(np.int32)
    scales = {name: move(s) for name, s in (("k_scale", case.k_scale), ("v_scale", case.v_scale))
              if isinstance(s, mx.array) and s.ndim == 3}
    return case.with_(key_pages=move(case.key_pages), value_pages=move(case.value_pages),
                      block_table=mx.array(table), **scales)


@pytest.mark.clause("inv2")
@pytest.mark.parametrize("k,v", [("token", "token"), ("head", "token")])
@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_page_order_moves_codes_and_scales(kv_dtype, k, v, attention):
    """Invariant 2 on quantized pages: a one-token decode over complete pages gives the
    same output (bit for bit under `bitwise_batch`) when the pages are renamed, each
    page's codes and per-token scales moving together."""
    base = paged_case(context_lens=[32, 16, 0, 48], query_len=1, q_heads=HQ, kv_heads=HKV, head_dim=D,
                      page_size=16, dtype="float32", seed=21)
    case = quantized(base, kv_dtype, k=k, v=v)
    attention.require_case(case)
    perm = np.random.default_rng(5).permutation(case.key_pages.shape[0])
    assert (perm != np.arange(len(perm))).any()
    assert_same_output(attention, _renamed(case, perm).run(attention), case.run(attention), case,
                       f"{case.name}: pages renamed")


def _regarbage(case, kv_dtype: str):
    """Other garbage where nothing may be read: the largest finite code (not the NaN one)
    in every free page and unused slot, and a huge per-token scale there."""
    written = np.zeros(case.key_pages.shape[:3], dtype=bool)  # [P, Hkv, ps]
    table, lens, ps = np.array(case.block_table), np.array(case.context_lens), case.page_size
    for b, ctx in enumerate(lens):
        for j in range(int(ctx)):
            written[table[b, j // ps], :, j % ps] = True
    top = 0x7E if kv_dtype == "float8_e4m3fn" else 0x7B if kv_dtype == "float8_e5m2" else 127  # finite, largest
    codes = lambda x: mx.where(mx.array(written)[..., None], x, mx.array(top).astype(x.dtype))  # noqa: E731
    scales = {name: mx.where(mx.array(written), s, mx.array(3e38, dtype=mx.float32))
              for name, s in (("k_scale", case.k_scale), ("v_scale", case.v_scale))
              if isinstance(s, mx.array) and s.ndim == 3}
    return case.with_(key_pages=codes(case.key_pages), value_pages=codes(case.value_pages), **scales)


@pytest.mark.clause("inv9")
@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_unread_slots_change_nothing(kv_dtype, attention):
    """Invariant 9 on quantized pages: free pages and the slots past each request's
    context hold the format's poison; other garbage there (the largest code, a huge
    per-token scale) gives the same output, bit for bit under `bitwise_batch`."""
    base = paged_case(context_lens=[21, 0, 7, 30], query_len=3, q_heads=HQ, kv_heads=HKV, head_dim=D,
                      page_size=16, dtype="bfloat16", seed=31)
    case = quantized(base, kv_dtype, k="token", v="token")
    attention.require_case(case)
    assert_same_output(attention, _regarbage(case, kv_dtype).run(attention), case.run(attention), case,
                       f"{case.name}: other garbage in unread slots")


def _request(case, b: int):
    return case.with_(query=case.query[b:b + 1], block_table=case.block_table[b:b + 1],
                      context_lens=case.context_lens[b:b + 1])


@pytest.mark.clause("inv6")
@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_batch_independent_bits(kv_dtype, attention):
    """Invariant 6 on quantized pages: each request's output bits alone equal its bits in
    the batch (per-head K scales, per-token V scales)."""
    attention.require("bitwise_batch")
    base = paged_case(context_lens=[70, 0, 9, 33], query_len=4, q_heads=HQ, kv_heads=HKV, head_dim=D,
                      page_size=16, dtype="bfloat16", seed=41)
    case = quantized(base, kv_dtype, k="head", v="token")
    attention.require_case(case)
    out = case.run(attention)
    for b in range(case.query.shape[0]):
        assert bits(_request(case, b).run(attention)) == bits(out[b:b + 1]), f"{case.name}: request {b}"


@pytest.mark.clause("inv8")
@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_prefill_rows_equal_their_decodes(kv_dtype, attention):
    """Invariant 8 on quantized pages: every prefill row's bits equal the one-token
    decode at its position (per-token K scales, per-tensor V scale)."""
    attention.require("bitwise_batch")
    base = paged_case(context_lens=[45, 8, 0], query_len=8, q_heads=HQ, kv_heads=HKV, head_dim=D, page_size=16,
                      dtype="float16", window=20, seed=51)
    case = quantized(base, kv_dtype, k="token", v="tensor")
    attention.require_case(case)
    out = case.run(attention)
    for l in range(case.query.shape[2]):
        assert bits(case.decode_row(l).run(attention)) == bits(out[:, :, l:l + 1]), f"{case.name}: row {l}"
