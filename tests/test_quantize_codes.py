"""The quantizing write path's encoding (impl/csrc/quantize.h) through a pool write: every
code round-trips, ties go to the even code, subnormals round on their own grid, values
saturate, NaN and -0 keep their sign; the expected codes are tests/quant_reference.py's
(its docstring states the rules).
"""

import math

import mlx.core as mx
import numpy as np
import pytest

from contract import max_finite
from fixtures.quantized import code_values
from fixtures.serving import raw
from impl.pool import PagePool
from tests.quant_reference import _magnitude_grid, reference_codes

pytestmark = [pytest.mark.correctness, pytest.mark.builtin_only("pagecheck's own page pool and its write path")]

FORMATS = ("float8_e4m3fn", "float8_e5m2", "int8")
GRANULARITIES = ("tensor", "head", "token")
ROW_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
TOP_CODE = {"float8_e4m3fn": 0x7E, "float8_e5m2": 0x7B, "int8": 0x7F}


def test_reference_agrees_with_hand_values():
    """The reference itself, on values checked by hand from the formats' tables."""
    y = np.array([1.0, 448.0, 464.0, 1e9, -np.inf, 2**-10, 3 * 2**-10, -2**-12, np.nan], dtype=np.float32)
    assert reference_codes(y, "float8_e4m3fn").tolist() == [0x38, 0x7E, 0x7E, 0x7E, 0xFE, 0, 2, 0x80, 0x7F]
    assert reference_codes(y, "int8").tolist() == [1, 127, 127, 127, 0x81, 0, 0, 0, 0]
    assert reference_codes(np.float32([2.5, -2.5, 61440, 2**-17]), "float8_e5m2").tolist() == [0x41, 0xC1, 0x7B, 0]


# -- writing values through a pool ----------------------------------------------------------------
def _as_rows(x: np.ndarray, dtype) -> mx.array:
    """float32 x in `dtype`, bit for bit where x is representable there (NaN signs too:
    MLX's own bfloat16 cast makes every NaN positive)."""
    if dtype == mx.bfloat16:
        return mx.array((x.view(np.uint32) >> 16).astype(np.uint16)).view(mx.bfloat16)
    return mx.array(x.astype(np.float16)) if dtype == mx.float16 else mx.array(x)


def write_row(x, kv_dtype, *, dtype=mx.float32, scale=1.0) -> np.ndarray:
    """The code bytes a one-page pool (tensor scale `scale`) stores for the values x (1-D);
    keys and values must agree."""
    x = np.asarray(x, dtype=np.float32)
    pool = PagePool(num_layers=1, kv_heads=1, head_dim=x.size, page_size=1, num_pages=1, dtype=dtype,
                    kv_dtype=kv_dtype, k_scale=scale, v_scale=scale)
    pool.allocate(1)
    rows = _as_rows(x.reshape(1, 1, -1), dtype)
    pool.write(0, [0], rows, rows)
    k, v = raw(pool.keys(0)).ravel(), raw(pool.values(0)).ravel()
    assert np.array_equal(k, v)
    return k


def _with_sign(values: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """code_values with NaN carrying its code's sign bit (numpy's -1.0 * NaN may not)."""
    out = values.astype(np.float32)
    return np.where(np.isnan(out), np.copysign(np.float32(np.nan), np.where(codes & 0x80, -1.0, 1.0)), out)


def _round_trip_expectation(kv_dtype: str) -> np.ndarray:
    """The code each code's value encodes back to: itself, except int8 -128 -> -127 (the
    symmetric range), e5m2 inf -> the largest finite, and every NaN code -> 0x7f / 0xff."""
    c = np.arange(256)
    if kv_dtype == "int8":
        return np.where(c == 0x80, 0x81, c)
    sign = c & 0x80
    if kv_dtype == "float8_e5m2":
        return np.where((c & 0x7F) == 0x7C, sign | 0x7B, np.where((c & 0x7F) > 0x7C, sign | 0x7F, c))
    return c


@pytest.mark.parametrize("dtype", ROW_DTYPES, ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_every_code_round_trips(kv_dtype, dtype):
    """decode(code) written back gives the code, for all 256 (rules in _round_trip_expectation;
    every value is exact in float16 and bfloat16 too, so those rows give the same codes)."""
    codes = np.arange(256)
    got = write_row(_with_sign(code_values(kv_dtype), codes), kv_dtype, dtype=dtype)
    assert got.tolist() == _round_trip_expectation(kv_dtype).tolist()


@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_ties_go_to_the_even_code(kv_dtype):
    """Every midpoint between adjacent finite codes (both signs) goes to the code with the
    even last bit; one float32 ulp either side goes to the nearer code."""
    codes, grid = _magnitude_grid(kv_dtype)
    mid = ((grid[:-1] + grid[1:]) / 2).astype(np.float32)
    assert np.array_equal(mid.astype(np.float64), (grid[:-1] + grid[1:]) / 2)  # exact in float32
    below, above = np.nextafter(mid, np.float32(0)), np.nextafter(mid, np.float32(np.inf))
    even = np.where(codes[:-1] % 2 == 0, codes[:-1], codes[1:])
    for sign in (1, -1):
        got = [write_row(sign * x, kv_dtype) for x in (mid, below, above)]
        want = [reference_codes(sign * x, kv_dtype) for x in (mid, below, above)]
        assert [g.tolist() for g in got] == [w.tolist() for w in want]
        signed_even = np.where(sign > 0, even, -even if kv_dtype == "int8" else even | 0x80) & 0xFF
        assert got[0].tolist() == signed_even.tolist()
    assert write_row(np.float32([2.5, 3.5, -2.5]), kv_dtype).tolist() == reference_codes(
        np.float32([2.5, 3.5, -2.5]), kv_dtype).tolist()


def _random_float32(rng, n: int, kv_dtype: str) -> np.ndarray:
    """Values over the format's whole range and past it: log-uniform magnitudes from 2^-5
    below the smallest subnormal to 2^3 above the largest finite, both signs, plus n raw
    float32 bit patterns (NaN, inf, float32 subnormals, huge and tiny values)."""
    lo = {"float8_e4m3fn": -14, "float8_e5m2": -21, "int8": -5}[kv_dtype]
    hi = math.log2(max_finite(kv_dtype)) + 3
    mags = np.exp2(rng.uniform(lo, hi, n)).astype(np.float32)
    signs = rng.choice(np.float32([-1, 1]), n)
    patterns = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)
    return np.concatenate([mags * signs, patterns])


@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_random_values_encode_like_the_reference(kv_dtype):
    x = _random_float32(np.random.default_rng(7), 4096, kv_dtype)
    assert write_row(x, kv_dtype).tolist() == reference_codes(x, kv_dtype).tolist()


@pytest.mark.parametrize("kv_dtype,step", [("float8_e4m3fn", 2.0**-9), ("float8_e5m2", 2.0**-16)])
def test_subnormals_round_on_their_own_grid(kv_dtype, step):
    """Below the smallest normal the codes are k * step (k < 2^M): values at k + f steps
    round to the nearest k, ties to even, carrying into the smallest normal."""
    k = np.arange(0, 9, dtype=np.float64)
    x = np.concatenate([(k + f) * step for f in (0.0, 0.25, 0.5, 0.75)]).astype(np.float32)
    got = write_row(x, kv_dtype)
    assert got.tolist() == reference_codes(x, kv_dtype).tolist()
    assert got[:9].tolist() == list(range(9))  # k steps is code k in both formats, up to 8 (a normal)
    half = got[18:27].tolist()  # (k + 1/2) steps: the even neighbour
    assert half == [int(v + (v % 2)) for v in range(9)]


@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_saturation(kv_dtype):
    """Past the largest finite value (its upper midpoint included), float32's max and inf
    all give +-max; never the NaN or inf code, and never int8's -128."""
    top = max_finite(kv_dtype)
    spacing = {"float8_e4m3fn": 32.0, "float8_e5m2": 8192.0, "int8": 1.0}[kv_dtype]
    over = np.float32([top + spacing / 2, top + spacing, 2 * top, 1e30, np.finfo(np.float32).max, np.inf])
    got = write_row(np.concatenate([over, -over, np.float32([-128.0, -127.5])]), kv_dtype)
    top_code, n = TOP_CODE[kv_dtype], len(over)
    negative_top = (-top_code) & 0xFF if kv_dtype == "int8" else top_code | 0x80
    assert got[:n].tolist() == [top_code] * n
    assert got[n:2 * n].tolist() == [negative_top] * n
    if kv_dtype == "int8":
        assert got[-2:].tolist() == [0x81, 0x81]  # -127, not -128 (the symmetric range)


@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_nan_gives_the_nan_code_with_its_sign(kv_dtype):
    nan = np.float32(np.nan)
    got = write_row(np.float32([nan, -nan, 1.0]), kv_dtype)
    want = [0, 0] if kv_dtype == "int8" else [0x7F, 0xFF]
    assert got[:2].tolist() == want
    assert code_values(kv_dtype)[got[2]] == 1.0


@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_negative_zero_keeps_its_sign_in_fp8(kv_dtype):
    got = write_row(np.float32([-0.0, -2.0**-30, 0.0, 2.0**-30]), kv_dtype)
    assert got.tolist() == ([0, 0, 0, 0] if kv_dtype == "int8" else [0x80, 0x80, 0, 0])


# -- scales -------------------------------------------------------------------------------------
