"""Oracle (b): gather every request into padded dense K/V, then batched dense attention.

`dense_gather` is also the control a paged kernel must beat (bench/ times it): one
vectorized gather through the whole block table, positions past a request's context
zeroed so that garbage (NaN) in unused slots cannot reach the output through 0 * NaN.

The score pipeline is applied to the whole padded score block at once (cap, ALiBi
bias, mask to -inf, `mx.softmax`); a sink is not a column of it: the keys' softmax
output is rescaled by their share `d_keys / (d_keys + e^sigma) = sigmoid(lse_keys - sigma)`
and the LSE is `logaddexp(lse_keys, sigma)` (`mx.logsumexp` over the keys).

Quantized pages (contract/kv_format.py) are dequantized as a whole pool before the
gather (which zeroes what no request may read, NaN codes included): each code indexes a
256-entry table of its format's values, built with `np.ldexp` from the integer
significand and the exponent,

| format   | code c = s eeee mmm / s eeeee mm              | table[c]                                       |
|----------|-----------------------------------------------|------------------------------------------------|
| e4m3fn   | e = (c >> 3) & 15, m = c & 7                  | ldexp(m + 8 [e > 0], max(e, 1) - 10); c & 0x7f = 0x7f NaN |
| e5m2     | e = (c >> 2) & 31, m = c & 3                  | ldexp(m + 4 [e > 0], max(e, 1) - 17); e = 31: inf (m = 0), NaN |
| int8     | the byte c (the code viewed as uint8)         | c - 256 [c >= 128]                             |

(negated when the sign bit is set), gathered with `mx.take` and times the scale
broadcast over the pool (`[]`, `[Hkv]` per KV head, `[P, Hkv, ps]` per physical slot).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from contract import ScorePipeline


# fp8 format -> (exponent bits, mantissa bits, bias)
_LAYOUT = {"float8_e4m3fn": (4, 3, 7), "float8_e5m2": (5, 2, 15)}


def code_table(kv_dtype: str) -> np.ndarray:
    """float64 [256]: the value of each code byte 0..255 of the format (int8: the byte as signed)."""
    c = np.arange(256)
    if kv_dtype == "int8":
        return np.where(c >= 128, c - 256, c).astype(np.float64)
    E, M, bias = _LAYOUT[kv_dtype]
    e, m = (c >> M) & ((1 << E) - 1), c & ((1 << M) - 1)
    significand = m + np.where(e > 0, 1 << M, 0)  # the implicit leading 1 of a normal number
    table = np.ldexp(significand.astype(np.float64), np.maximum(e, 1) - bias - M)
    top = e == (1 << E) - 1
    if kv_dtype == "float8_e4m3fn":
        table[top & (m == (1 << M) - 1)] = np.nan
    else:
        table[top] = np.where(m[top] == 0, np.inf, np.nan)
    return np.where(c >= 128, -table, table)


def dequantize(pages, kv_dtype: str, scale) -> mx.array:
    """float32 pool: table[code] times the scale broadcast over `[P, Hkv, ps, D]`."""
    want = mx.int8 if kv_dtype == "int8" else mx.uint8
    if pages.dtype != want:
        raise ValueError(f"{kv_dtype} pages hold {want} codes, got {pages.dtype}")
    table = mx.array(code_table(kv_dtype).astype(np.float32))
    values = mx.take(table, pages.view(mx.uint8) if kv_dtype == "int8" else pages)
    s = mx.array(1.0 if scale is None else scale).astype(mx.float32)
    P, hkv, ps = pages.shape[:3]
    if s.shape == (hkv,):
        s = s.reshape(1, hkv, 1, 1)
    elif s.shape == (P, hkv, ps):
        s = s[..., None]
    elif s.ndim != 0:
        raise ValueError(f"a scale must have shape [], [Hkv] or [P, Hkv, ps], got {list(s.shape)}")
    return values * s


def dense_gather(key_pages, value_pages, block_table, context_lens, page_size):
    """Returns (K, V, valid): K `[B, Hkv, S, Dk]`, V `[B, Hkv, S, Dv]` with S = pages * page_size,
    valid `[B, S]`."""
    P = key_pages.shape[0]
    # Pages the longest request reads; 0 when every row is empty (or B = 0): then the
    # gather is zero-width, so a pool of 0 pages or a table of 0 columns is never indexed.
    n_pages = -(-int(context_lens.max().item()) // page_size) if context_lens.size else 0
    ids = mx.clip(block_table[:, :n_pages], 0, max(P - 1, 0))  # unused entries may be -1 or garbage
    positions = mx.arange(n_pages * page_size)[None, :]
    valid = positions < context_lens[:, None]

    def gather(pages):
        g = pages[ids]  # [B, n_pages, Hkv, ps, D]
        B, n, hkv, ps, d = g.shape
        dense = g.transpose(0, 2, 1, 3, 4).reshape(B, hkv, n * ps, d)
        return mx.where(valid[:, None, :, None], dense, mx.zeros((), dtype=dense.dtype))

    return gather(key_pages), gather(value_pages), valid


def _per_head(x, Hkv, G):
    return None if x is None else mx.array(x).astype(mx.float32).reshape(1, Hkv, G, 1, 1)


def dense_attention(query, keys, values, context_lens, **options):
    """Batched attention over padded dense K/V; query head h reads KV head h // (Hq // Hkv).
    keys `[B, Hkv, S, Dk]`, values `[B, Hkv, S, Dv]`; the options are the score pipeline's
    (contract/pipeline.py). Returns `[B, Hq, L, Dv]`, or (out, lse `[B, Hq, L]` float32)."""
    opts = ScorePipeline.of(options)
    B, Hq, L, D = query.shape
    Hkv, S, Dv = keys.shape[1], keys.shape[2], values.shape[-1]
    G = Hq // Hkv
    scale = D ** -0.5 if opts.scale is None else opts.scale
    q = query.astype(mx.float32).reshape(B, Hkv, G, L, D)
    k = keys.astype(mx.float32)[:, :, None]
    v = values.astype(mx.float32)[:, :, None]
    scores = (q @ k.swapaxes(-1, -2)) * scale  # [B, Hkv, G, L, S]
    if opts.softcap is not None:
        cap = float(opts.softcap)
        scores = cap * mx.tanh(scores / cap)
    key = mx.arange(S)[None, None, :]
    ctx = context_lens[:, None, None]
    pos = ctx - L + mx.arange(L)[None, :, None]  # [B, L, 1]: each query row's position
    slopes = _per_head(opts.alibi_slopes, Hkv, G)
    if slopes is not None:
        scores = scores + slopes * (key - pos).astype(mx.float32)[:, None, None]
    seen = key < ctx
    if opts.mask is not None:
        seen = seen & (key <= pos)
        if opts.window is not None:
            seen = seen & (key > pos - opts.window)
    scores = mx.where(seen[:, None, None], scores, -mx.inf)
    weights = mx.softmax(scores, axis=-1, precise=True)
    out = weights @ v  # [B, Hkv, G, L, Dv]: the keys' own softmax
    live = (context_lens > 0)[:, None, None, None]
    if opts.sinks is None and not opts.return_lse:
        out = out.reshape(B, Hq, L, Dv)
        out = mx.where(live, out, 0.0)  # empty slots: 0, not NaN
        return out.astype(query.dtype)
    # LSE of the keys alone (S = 0 when every row is empty: nothing to reduce)
    lse = mx.logsumexp(scores, axis=-1) if S else mx.full(scores.shape[:-1], -mx.inf)
    sinks = _per_head(opts.sinks, Hkv, G)
    if sinks is not None:  # the sink takes its share: out * d_keys / (d_keys + e^sigma)
        sinks = sinks[..., 0]  # [1, Hkv, G, 1]
        out = out * mx.sigmoid(lse - sinks)[..., None]
        lse = mx.logaddexp(lse, sinks)
    out = mx.where(live, out.reshape(B, Hq, L, Dv), 0.0)  # empty slots: 0, not NaN
    lse = mx.where(live[..., 0], lse.reshape(B, Hq, L), -mx.inf)  # and lse -inf, sinks ignored
    out = out.astype(query.dtype)
    return (out, lse) if opts.return_lse else out


def attention(query, key_pages, value_pages, block_table, context_lens, page_size, **options):
    pipeline = ScorePipeline.of(options)
    kv = pipeline.kv
    if kv.quantized:
        key_pages = dequantize(key_pages, kv.dtype, kv.k_scale)
        value_pages = dequantize(value_pages, kv.dtype, kv.v_scale)
        options = pipeline.with_(kv_dtype=None, k_scale=None, v_scale=None).kwargs()  # float K/V from here on
    keys, values, _ = dense_gather(key_pages, value_pages, block_table, context_lens, page_size)
    return dense_attention(query, keys, values, context_lens, **options)
