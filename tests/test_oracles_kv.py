"""Quantized KV pages in the oracles (REFERENCE.md 1b, "fp8 / int8 KV"; contract/kv_format.py).

| test                         | what it pins down                                                 |
|------------------------------|-------------------------------------------------------------------|
| `decode_through_values`      | each oracle's V decode of all 256 codes of each format: one visible key, so the output row is that key's value row exactly; named specials by value |
| `decode_through_keys`        | each oracle's K decode of every finite code: score = a * decode(c) with a = 1 / abs(value(c)), so the output is sigmoid(+-1) (or 1/2 for zero) |
| `own_decode`                 | each oracle module's own decode / table against the named specials, -0.0's sign too |
| `mlx_oracles_agree`          | equation, dense, sdpa against float64 under the tolerance rule and its a-priori form, format x K/V granularity x dtype x decode / prefill x page size 1 / 16, GQA |
| `kernel_passes_compare`      | the built-in kernel on the same cases: `compare(...).failures() == []` |
| `contract_v2_options_*`      | the kernel with sinks + ALiBi (SDPA in float32), soft-cap + LSE (SDPA left out), a window, on quantized pages |
| `allowance_reads_values`     | value_scale and call_logit_error read the dequantized pool, not the codes |
| `quantization_error_*`       | > 0, within the bound derived from the per-element rounding, int8 < e4m3 < e5m2, exactly 0 over the dequantized values themselves |
| `unwritten_slots`            | NaN codes (and int8 -128 with NaN token scales) in unwritten slots change no bit |

Expected values come from `fixtures.quantized.code_values` (built from the bit layout in
fixtures/, sharing nothing with oracles/) and from literals for the named specials.
"""

import itertools
import math

import mlx.core as mx
import numpy as np
import pytest

import impl
import oracles
from fixtures import paged_case, to_numpy
from fixtures.quantized import code_values, quantized
from oracles import dense, equation, numpy64, sdpa
from oracles.compare import allowance, call_logit_error, compare, value_scale
from oracles.tolerance import max_abs_error

pytestmark = pytest.mark.correctness

FORMATS = ("float8_e4m3fn", "float8_e5m2", "int8")
ORACLES = {"float64": oracles.float64, **oracles.MLX_ORACLES}
# code byte -> its value (NaN as float("nan")); -0.0 is checked for its sign where it can be
SPECIALS = {
    "float8_e4m3fn": {0x01: 2.0 ** -9, 0x07: 7 * 2.0 ** -9, 0x08: 2.0 ** -6, 0x38: 1.0, 0x7E: 448.0,
                      0x80: -0.0, 0xFE: -448.0, 0x7F: math.nan, 0xFF: math.nan},
    "float8_e5m2": {0x01: 2.0 ** -16, 0x03: 3 * 2.0 ** -16, 0x04: 2.0 ** -14, 0x3C: 1.0, 0x7B: 57344.0,
                    0x7C: math.inf, 0xFC: -math.inf, 0x7D: math.nan, 0x7F: math.nan, 0x80: -0.0},
    "int8": {0x01: 1.0, 0x7F: 127.0, 0x80: -128.0, 0x81: -127.0, 0xFF: -1.0},
}
ONE = {"float8_e4m3fn": 0x38, "float8_e5m2": 0x3C, "int8": 0x01}  # the code of 1.0


def _codes(kv_dtype: str, values) -> np.ndarray:
    """Code bytes 0..255 in the format's storage dtype."""
    codes = np.asarray(values).astype(np.uint8)
    return codes.view(np.int8) if kv_dtype == "int8" else codes


def _with_slot(pages: mx.array, page: int, slot: int, codes: np.ndarray) -> mx.array:
    """The pool with `[page, :, slot, :]` replaced by codes `[Hkv, D]`."""
    host = np.array(pages)
    host[page, :, slot, :] = codes
    return mx.array(host)


def _host(out) -> np.ndarray:
    return np.asarray(to_numpy(out) if isinstance(out, mx.array) else out, dtype=np.float64)


def _single_key_case(kv_dtype: str, *, keys: int, query_len: int, mask):
    """One request of `keys` positions on 16 KV heads of dim 16 (16 x 16 = 256 code slots per
    position), unscaled codes, unwritten slots poisoned by the fixture."""
    base = paged_case(context_lens=[keys], query_len=query_len, q_heads=16, kv_heads=16, head_dim=16,
                      page_size=4, extra_pages=2, mask=mask, scale=1.0, seed=11)
    return quantized(base, kv_dtype).with_(k_scale=None, v_scale=None)


@pytest.mark.parametrize("oracle", sorted(ORACLES))
@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_decode_through_values(kv_dtype, oracle):
    """One visible key: its softmax weight is exactly 1, so output row h is V row h decoded."""
    case = _single_key_case(kv_dtype, keys=1, query_len=1, mask="causal")
    page = int(np.array(case.block_table)[0, 0])
    every_code = _codes(kv_dtype, np.arange(256).reshape(16, 16))  # head h, dim d: code 16 h + d
    case = case.with_(value_pages=_with_slot(case.value_pages, page, 0, every_code))
    got = _host(case.run(ORACLES[oracle]))[0, :, 0, :].reshape(256)
    np.testing.assert_array_equal(got, code_values(kv_dtype))  # NaN where NaN, inf where inf
    for code, value in SPECIALS[kv_dtype].items():
        assert got[code] == value or (math.isnan(value) and math.isnan(got[code])), (hex(code), got[code], value)


def _key_query(kv_dtype: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(key codes [16, 16] with non-finite ones replaced by 0, query [16, 16, 16] float32:
    row l of head h one-hot at l with magnitude a = 1 / |value| (1 for zero), expected
    output [16, 16]: sigmoid of the score a * value against a zero key)."""
    values = code_values(kv_dtype)
    codes = np.where(np.isfinite(values), np.arange(256), 0).reshape(16, 16)
    v = values[codes]
    a = np.where(v != 0, 1.0 / np.where(v != 0, np.abs(v), 1.0), 1.0).astype(np.float32)
    q = np.zeros((16, 16, 16), dtype=np.float32)
    q[:, np.arange(16), np.arange(16)] = a
    score = a.astype(np.float64) * v
    return codes, q, 1.0 / (1.0 + np.exp(-score))


@pytest.mark.parametrize("oracle", sorted(ORACLES))
@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_decode_through_keys(kv_dtype, oracle):
    """Keys [code c, zero], values [1, 0]: output = sigmoid(a * decode(c)) = sigmoid(+-1); a
    decode off by a power of 2 or a sign gives sigmoid(+-2), sigmoid(-+1), ..."""
    codes, q, want = _key_query(kv_dtype)
    case = _single_key_case(kv_dtype, keys=2, query_len=16, mask=None)
    page = int(np.array(case.block_table)[0, 0])
    zeros = np.zeros((16, 16), dtype=np.int64)
    keys = _with_slot(_with_slot(case.key_pages, page, 0, _codes(kv_dtype, codes)), page, 1, _codes(kv_dtype, zeros))
    ones = np.full((16, 16), ONE[kv_dtype])
    values = _with_slot(_with_slot(case.value_pages, page, 0, _codes(kv_dtype, ones)), page, 1,
                        _codes(kv_dtype, zeros))
    case = case.with_(query=mx.array(q[None]), key_pages=keys, value_pages=values)
    got = _host(case.run(ORACLES[oracle]))[0]  # [Hq, L, Dv]: every value dim carries the weight
    np.testing.assert_allclose(got, np.broadcast_to(want[..., None], got.shape), rtol=0, atol=1e-6)


OWN_DECODE = {
    "float64": lambda codes, fmt: numpy64.decode(codes, fmt),
    "equation": lambda codes, fmt: np.array(equation.decode(mx.array(codes), fmt)),
    "dense": lambda codes, fmt: dense.code_table(fmt)[codes.view(np.uint8)],
    "sdpa": lambda codes, fmt: np.array(sdpa.decode(mx.array(codes), fmt)),
}


@pytest.mark.parametrize("oracle", sorted(OWN_DECODE))
@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_own_decode(kv_dtype, oracle):
    """The sign of -0.0 cannot come through attention (0 + -0.0 = +0.0), so it is read here."""
    got = OWN_DECODE[oracle](_codes(kv_dtype, np.arange(256)), kv_dtype).astype(np.float64)
    np.testing.assert_array_equal(got, code_values(kv_dtype))
    for code, value in SPECIALS[kv_dtype].items():
        if not math.isnan(value):
            assert got[code] == value and np.signbit(got[code]) == np.signbit(value), (hex(code), got[code])


# (K granularity, V granularity): each alone, and mixed so that K's scale read at V's index shows
GRANULARITIES = (("tensor", "tensor"), ("head", "head"), ("token", "token"), ("tensor", "token"), ("token", "head"))
# (L, page size, context lens): decode and prefill, one-slot and 16-slot pages; an empty row in one
SHAPES = {"decode-ps16": (1, 16, [37, 0, 20]), "decode-ps1": (1, 1, [9, 4]),
          "prefill-ps16": (5, 16, [23, 9]), "prefill-ps1": (5, 1, [11, 6])}
DTYPES = ("float32", "float16", "bfloat16")


def _case(kv_dtype, k, v, dtype, shape, seed=0, **options):
    L, ps, lens = SHAPES[shape]
    base = paged_case(context_lens=lens, query_len=L, q_heads=4, kv_heads=2, head_dim=16, page_size=ps,
                      dtype=dtype, seed=seed)
    return quantized(base, kv_dtype, k=k, v=v).with_(**options)


GRID = [pytest.param(f, k, v, d, s, id=f"{f}-{k}/{v}-{d}-{s}")
        for f, (k, v), d, s in itertools.product(FORMATS, GRANULARITIES, DTYPES, SHAPES)]


@pytest.mark.parametrize("kv_dtype,k,v,dtype,shape", GRID)
def test_mlx_oracles_agree(kv_dtype, k, v, dtype, shape):
    """Under the rule, and under its a-priori form (E_na, no SDPA): the rule's e_sdpa grows
    with SDPA's distance from float64, so a float64 oracle misreading the codes would widen
    its own allowance; the a-priori one does not move with it."""
    case = _case(kv_dtype, k, v, dtype, shape, seed=len(shape) + len(dtype))
    result = compare(case.run(oracles.float64), case.args(), case.kwargs())
    assert set(result.oracle_self) == set(oracles.MLX_ORACLES), result.not_applicable
    bad = [f"{n}: {v}" for n, v in result.oracle_self.items() if not v.ok]
    assert not bad, bad
    ref = case.run(oracles.float64)
    a_priori = allowance(case.args(), ref, None, case.kwargs())
    errors = {name: max_abs_error(case.run(fn), ref) for name, fn in oracles.MLX_ORACLES.items()}
    assert max(errors.values()) <= a_priori, (errors, a_priori)


@pytest.mark.parametrize("kv_dtype,k,v,dtype,shape", GRID)
def test_kernel_passes_compare(kv_dtype, k, v, dtype, shape):
    case = _case(kv_dtype, k, v, dtype, shape, seed=len(shape) * len(dtype))
    out = case.run(impl.paged_attention)
    assert out.dtype == case.dtype and out.shape == case.query.shape
    result = compare(out, case.args(), case.kwargs())
    assert result.failures() == [], result.failures()


# contract-v2 options on quantized pages: SDPA expresses sinks and ALiBi in float32 (exactly,
# whatever the query's dtype); soft-cap and the LSE leave it out (the allowance then rests on
# call_logit_error, i.e. on the dequantized keys' norms)
V2 = {"sinks-alibi": dict(sinks=mx.array(np.array([0.3, -1.3, 2.7, 0.01], np.float32)),
                          alibi_slopes=mx.array(np.array([0.3, 0.17, 0.071, 0.0123], np.float32))),
      "softcap-lse": dict(softcap=1.5, return_lse=True),
      "window": dict(window=3)}


@pytest.mark.parametrize("v2", sorted(V2))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_contract_v2_options_on_quantized_pages(kv_dtype, dtype, v2):
    case = _case(kv_dtype, "token", "head", dtype, "prefill-ps1", seed=5, **V2[v2])
    result = compare(case.run(impl.paged_attention), case.args(), case.kwargs())
    assert result.failures() == [], result.failures()
    assert set(result.oracle_self) == set(oracles.MLX_ORACLES) - ({"sdpa"} if v2 == "softcap-lse" else set())


def _dequantized(case) -> tuple[np.ndarray, np.ndarray]:
    """float64 K and V pools of a quantized case from fixtures' code table (NaN where unwritten)."""
    def one(pages, scale):
        values = code_values(case.kv_dtype)[np.array(pages).view(np.uint8).astype(np.int64)]
        s = np.array(scale, dtype=np.float64)
        s = s[None, :, None, None] if s.ndim == 1 else s[..., None] if s.ndim == 3 else s
        with np.errstate(invalid="ignore"):
            return values * s
    return one(case.key_pages, case.k_scale), one(case.value_pages, case.v_scale)


def _finite_max(x: np.ndarray) -> float:
    return float(np.abs(x[np.isfinite(x)]).max())


@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_allowance_reads_values_not_codes(kv_dtype):
    """Codes run to 127 (int8) or 255 (a uint8 byte); the values here to ~4: an allowance
    read from the codes would be 30-60 times too loose. V has token scales so that int8's
    poison (-128, finite) sits under a NaN scale: a finite poison value would count, as
    finite garbage in a float pool does."""
    case = _case(kv_dtype, "head", "token", "float32", "decode-ps16")
    keys, values = _dequantized(case)
    assert value_scale(case.value_pages, kv_dtype, case.v_scale) == _finite_max(values)
    assert value_scale(case.value_pages, kv_dtype, case.v_scale) < 10
    # the same call over float32 pages of the dequantized values has the same delta
    plain = case.with_(key_pages=mx.array(keys.astype(np.float32)), value_pages=mx.array(values.astype(np.float32)),
                       kv_dtype=None, k_scale=None, v_scale=None)
    assert call_logit_error(case.args(), case.kwargs()) == pytest.approx(
        call_logit_error(plain.args(), plain.kwargs()), rel=1e-6)


def _float_case(kv_dtype, granularity, seed):
    base = paged_case(context_lens=[37, 0, 20], query_len=3, q_heads=4, kv_heads=2, head_dim=16, page_size=4,
                      seed=seed)
    return base, quantized(base, kv_dtype, k=granularity)


def _written_max(x: np.ndarray) -> float:
    return _finite_max(x) if np.isfinite(x).any() else 0.0


@pytest.mark.parametrize("granularity", ("tensor", "head", "token"))
@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_quantization_error_is_positive_and_bounded(kv_dtype, granularity):
    """|o_q - o| <= max|V_q - V| + expm1(2 delta) max|V|, delta = |scale| max||q|| max||K_q - K||:
    every logit moves by at most delta, each weight by a factor within e^(+-2 delta)."""
    base, case = _float_case(kv_dtype, granularity, seed=7)
    err = oracles.quantization_error(case.args(), case.kwargs(), base.key_pages, base.value_pages)
    keys, values = _dequantized(case)
    k, v = np.array(base.key_pages, dtype=np.float64), np.array(base.value_pages, dtype=np.float64)
    dv = _written_max(values - v)
    dk = np.sqrt(np.nansum((keys - k) ** 2, axis=-1)).max()
    q = np.array(base.query, dtype=np.float64)
    delta = 16 ** -0.5 * np.sqrt((q * q).sum(axis=-1)).max() * dk
    assert 0 < err <= dv + math.expm1(2 * delta) * _written_max(v)


@pytest.mark.parametrize("granularity", ("tensor", "token"))
def test_quantization_error_orders_formats(granularity):
    """On the same data, 7-bit int8 steps (a scale per tensor or row) beat 3 mantissa bits,
    which beat 2. (Per-head scales 2^(g+1) apart coarsen int8's grid: no order there.)"""
    errs = {}
    for kv_dtype in FORMATS:
        base, case = _float_case(kv_dtype, granularity, seed=7)
        errs[kv_dtype] = oracles.quantization_error(case.args(), case.kwargs(), base.key_pages, base.value_pages)
    assert errs["int8"] < errs["float8_e4m3fn"] < errs["float8_e5m2"], errs


@pytest.mark.parametrize("granularity", ("tensor", "head", "token"))
@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_quantization_error_zero_over_dequantized_values(kv_dtype, granularity):
    """code values have at most 4 significant bits and scales 24: their float64 products are
    exact, so attention over them is the quantized call itself, bit for bit."""
    _, case = _float_case(kv_dtype, granularity, seed=3)
    keys, values = _dequantized(case)
    assert oracles.quantization_error(case.args(), case.kwargs(), keys, values) == 0.0


def _written(case) -> np.ndarray:
    """bool [P, ps]: the slots some request's context covers."""
    table, lens = np.array(case.block_table), np.array(case.context_lens)
    written = np.zeros((case.key_pages.shape[0], case.page_size), dtype=bool)
    for b, ctx in enumerate(lens):
        j = np.arange(ctx)
        written[table[b, j // case.page_size], j % case.page_size] = True
    return written


def _refilled(case, code: int, scale: float):
    """The case with every unwritten slot holding `code` and, with token scales, `scale`."""
    page, slot = np.nonzero(~_written(case))

    def pages(x):
        host = np.array(x)
        host[page, :, slot] = _codes(case.kv_dtype, [code])[0]
        return mx.array(host)

    def scales(s):
        if s.ndim != 3:
            return s
        host = np.array(s)
        host[page, :, slot] = scale
        return mx.array(host)

    return case.with_(key_pages=pages(case.key_pages), value_pages=pages(case.value_pages),
                      k_scale=scales(case.k_scale), v_scale=scales(case.v_scale))


@pytest.mark.parametrize("oracle", sorted(ORACLES))
@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_unwritten_slots_never_read(kv_dtype, oracle):
    """The fixture's poison (NaN codes; int8's -128 under a NaN token scale) against the
    format's largest code under a large scale there: not one output bit may differ."""
    case = _case(kv_dtype, "token", "token", "float32", "prefill-ps16", seed=2)
    page, slot = np.nonzero(~_written(case))
    assert page.size and np.isnan(np.array(case.k_scale)[page, :, slot]).all()
    big = {"float8_e4m3fn": 0x7E, "float8_e5m2": 0x7B, "int8": 0x7F}[kv_dtype]
    poisoned = _host(case.run(ORACLES[oracle]))
    loud = _host(_refilled(case, big, 1e3).run(ORACLES[oracle]))
    assert np.isfinite(poisoned).all()
    np.testing.assert_array_equal(poisoned, loud)
