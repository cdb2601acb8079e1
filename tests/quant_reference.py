"""The expected codes of the quantizing write path (impl/csrc/quantize.h), for
tests/test_quantize_codes.py and tests/test_pool_quant.py: `reference_codes` gives the nearest value of the format's
code table (`fixtures.quantized.code_values`, built from the bit layout, nothing shared
with impl/), ties to the even code, clamped to the largest finite value, compared in
float64 where every midpoint is exact. The rules it states:

| input y = fl32(x / s)       | fp8 code                                 | int8 code |
|-----------------------------|------------------------------------------|-----------|
| finite                      | nearest, ties to even, clamped to +-max  | nearest, ties to even, clamped to +-127 |
| +-inf                       | +-max (0x7e / 0xfe e4m3, 0x7b / 0xfb e5m2) | +-127   |
| NaN                         | 0x7f, 0xff with the sign bit set          | 0         |
| negative, rounding to 0     | 0x80 (-0)                                | 0         |
"""

from __future__ import annotations

import numpy as np

from contract import max_finite
from fixtures.quantized import code_values


def _magnitude_grid(kv_dtype):
    """(codes, values) of the non-negative finite codes up to the largest finite value,
    ascending (int8: 0..127; -128 and the negative codes are their mirror images)."""
    codes = np.arange(128)
    values = code_values(kv_dtype)[codes]
    keep = np.isfinite(values) & (values <= max_finite(kv_dtype))
    return codes[keep], values[keep]


def reference_codes(y: np.ndarray, kv_dtype: str) -> np.ndarray:
    """The code bytes (uint8; int8 codes as their two's complement byte) of float32 y,
    by the rules of the module docstring."""
    y = np.asarray(y, dtype=np.float32)
    codes, grid = _magnitude_grid(kv_dtype)
    a = np.minimum(np.abs(np.where(np.isnan(y), 0.0, y).astype(np.float64)), grid[-1])
    hi = np.clip(np.searchsorted(grid, a), 0, len(grid) - 1)
    lo = np.maximum(hi - 1, 0)
    mid = (grid[lo] + grid[hi]) / 2  # exact: fp8 / int8 values have few significant bits
    even = np.where(codes[lo] % 2 == 0, lo, hi)
    pick = np.where(grid[hi] == a, hi, np.where(a < mid, lo, np.where(a > mid, hi, even)))
    mag = codes[pick]
    neg = np.signbit(y)
    if kv_dtype == "int8":
        out = np.where(neg, (-mag) & 0xFF, mag)
        return np.where(np.isnan(y), 0, out).astype(np.uint8)
    return np.where(np.isnan(y), 0x7F, mag).astype(np.uint8) | (neg.astype(np.uint8) << 7)
