"""Oracle (d): float64 NumPy reference, written straight from the contract.

No MLX here, no shared helper with impl/ or the other oracles: each key is found with
the addressing formula itself, `pages[block_table[b, j // page_size], g, j % page_size]`,
and each query row is reduced over exactly the keys it may see. The score pipeline
(contract/pipeline.py) is applied row by row in float64, in its order: scale, soft-cap
`c * tanh(s / c)` (NumPy's tanh saturates to +-1, it never overflows), ALiBi
`slope_h * (j - p)`, mask (only visible keys are taken), then the softmax with the sink
logit `sigma_h` in its max and its denominator only.

Quantized pages (contract/kv_format.py) are decoded here from the format's bit fields,
by the formula, in float64: for a code with sign bit s, exponent field e (E bits) and
mantissa field m (M bits),

| exponent field | value                                     |
|----------------|-------------------------------------------|
| e = 0          | (-1)^s * 2^(1 - bias) * m / 2^M  (subnormal) |
| 0 < e          | (-1)^s * 2^(e - bias) * (1 + m / 2^M)       |
| e4m3fn e = 15, m = 7 | NaN (no inf)                        |
| e5m2 e = 31    | inf (m = 0), NaN (m > 0)                  |

(e4m3fn: E 4, M 3, bias 7; e5m2: E 5, M 2, bias 15), int8 the integer itself; then
times the scale at the key's own `[page, g, slot]` (a float64 product of a code of at
most 4 significant bits and a float32 scale: exact).
"""

from __future__ import annotations

import numpy as np

from contract import ScorePipeline


def visible_keys(ctx: int, L: int, l: int, causal: bool, window: int | None) -> np.ndarray:
    """Absolute key positions query row l of a request with ctx positions sees."""
    if not causal:
        return np.arange(ctx)
    p = ctx - L + l
    first = 0 if window is None else max(0, p - window + 1)
    return np.arange(first, p + 1)


def _per_head(x, Hq: int, name: str) -> np.ndarray | None:
    """Slopes or sinks as float64 `[Hq]`, from NumPy, an mx.array (through `.tolist()`,
    any float dtype, exactly) or a sequence."""
    if x is None:
        return None
    values = np.asarray(x.tolist() if hasattr(x, "tolist") else x, dtype=np.float64)
    if values.shape != (Hq,):
        raise ValueError(f"{name} must have shape [Hq] = [{Hq}], got {list(values.shape)}")
    return values


# fp8 format -> (exponent bits E, mantissa bits M, bias)
FP8_FIELDS = {"float8_e4m3fn": (4, 3, 7), "float8_e5m2": (5, 2, 15)}
STORAGE = {"float8_e4m3fn": np.uint8, "float8_e5m2": np.uint8, "int8": np.int8}


def decode(codes, kv_dtype: str) -> np.ndarray:
    """float64 values of the codes (uint8 bit patterns for fp8, int8 for int8), unscaled."""
    codes = np.asarray(codes)
    if kv_dtype not in STORAGE:
        raise ValueError(f"unknown kv_dtype {kv_dtype!r}")
    if codes.dtype != STORAGE[kv_dtype]:
        raise ValueError(f"{kv_dtype} pages hold {np.dtype(STORAGE[kv_dtype]).name} codes, got {codes.dtype}")
    if kv_dtype == "int8":
        return codes.astype(np.float64)
    E, M, bias = FP8_FIELDS[kv_dtype]
    c = codes.astype(np.int64)
    negative = (c >> 7) == 1
    e = (c >> M) & ((1 << E) - 1)
    m = (c & ((1 << M) - 1)).astype(np.float64)
    fraction = m / 2.0 ** M
    magnitude = np.where(e == 0, 2.0 ** (1 - bias) * fraction, 2.0 ** (e - bias) * (1.0 + fraction))
    top = e == (1 << E) - 1
    if kv_dtype == "float8_e4m3fn":  # only all-ones is NaN; the rest of the top binade is finite
        magnitude = np.where(top & (m == 7), np.nan, magnitude)
    else:
        magnitude = np.where(top, np.where(m == 0, np.inf, np.nan), magnitude)
    return np.where(negative, -magnitude, magnitude)


def scale_array(scale) -> np.ndarray:
    """A `k_scale` / `v_scale` as float64 (None: 1.0), from a number, NumPy or an mx.array
    (through `.tolist()`, exactly)."""
    if scale is None:
        return np.float64(1.0)
    return np.asarray(scale.tolist() if hasattr(scale, "tolist") else scale, dtype=np.float64)


def dequantize(pages, kv_dtype: str | None, scale=None) -> np.ndarray:
    """float64 `[P, Hkv, ps, D]`: element `[p, g, slot, d]` is `decode(code) * s`, s the
    scale of its granularity (`[]`: s; `[Hkv]`: s[g]; `[P, Hkv, ps]`: s[p, g, slot], the
    physical slot). Without a format: the pages as float64. Unwritten slots may decode to
    NaN / inf (or meet a NaN token scale): callers never read them."""
    if kv_dtype is None:
        return np.asarray(pages, dtype=np.float64)
    values = decode(pages, kv_dtype)
    s = scale_array(scale)
    P, Hkv, ps = values.shape[:3]
    if s.shape == (Hkv,):
        s = s[None, :, None, None]
    elif s.shape == (P, Hkv, ps):
        s = s[..., None]
    elif s.shape != ():
        raise ValueError(f"a scale must have shape [], [Hkv] = [{Hkv}] or [P, Hkv, ps] = [{P}, {Hkv}, {ps}], "
                         f"got {list(s.shape)}")
    with np.errstate(invalid="ignore"):  # inf code * NaN token scale in a slot nobody reads
        return values * s


def attention_f64(query, key_pages, value_pages, block_table, context_lens, page_size, **options):
    """Returns float64 `[B, Hq, L, Dv]`, or `(out, lse)` with `return_lse=True` (lse float64
    `[B, Hq, L]`, natural log, `-inf` on an empty slot); inputs are array-likes (any float
    dtype; with a `kv_dtype`, the pages hold its codes)."""
    opts = ScorePipeline.of(options)
    q = np.asarray(query, dtype=np.float64)
    kp = dequantize(key_pages, opts.kv_dtype, opts.k_scale)
    vp = dequantize(value_pages, opts.kv_dtype, opts.v_scale)
    table = np.asarray(block_table)
    lens = np.asarray(context_lens)
    B, Hq, L, Dk = q.shape
    Hkv, Dv = kp.shape[1], vp.shape[-1]
    group = Hq // Hkv
    scale = Dk ** -0.5 if opts.scale is None else float(opts.scale)
    cap = None if opts.softcap is None else float(opts.softcap)
    slopes = _per_head(opts.alibi_slopes, Hq, "alibi_slopes")
    sinks = _per_head(opts.sinks, Hq, "sinks")
    out = np.zeros((B, Hq, L, Dv), dtype=np.float64)
    lse = np.full((B, Hq, L), -np.inf, dtype=np.float64)
    for b in range(B):
        ctx = int(lens[b])
        if ctx == 0:  # an empty slot: zeros, lse -inf, its sink ignored
            continue
        for h in range(Hq):
            g = h // group
            for l in range(L):
                p = ctx - L + l
                j = visible_keys(ctx, L, l, opts.mask is not None, opts.window)
                pages = table[b, j // page_size]
                keys = kp[pages, g, j % page_size, :]
                values = vp[pages, g, j % page_size, :]
                s = keys @ q[b, h, l] * scale
                if cap is not None:
                    s = cap * np.tanh(s / cap)
                if slopes is not None:
                    s = s + slopes[h] * (j - p).astype(np.float64)
                m = s.max() if sinks is None else max(s.max(), sinks[h])
                w = np.exp(s - m)
                d = w.sum() + (0.0 if sinks is None else np.exp(sinks[h] - m))
                out[b, h, l] = (w / d) @ values
                lse[b, h, l] = m + np.log(d)
    return (out, lse) if opts.return_lse else out
