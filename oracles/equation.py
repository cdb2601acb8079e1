"""Oracle (a): the attention equation in mlx.core, one request at a time.

K/V are gathered through the block table with `mx.take`, then the textbook steps are
spelled out: scores, soft-cap (`c * tanh(s / c)`: MLX's tanh saturates, no exp), ALiBi
bias, mask, softmax (max-shifted exp over its sum, the sink's `e^(sigma - m)` added to
the sum and `sigma` to the max), weighted sum, LSE `m + log(sum)`, all in float32, the
output cast once to the query's dtype.

Quantized pages (contract/kv_format.py): the request's codes and their scales are taken
through the same table row, then decoded with integer bit operations into float16 bit
patterns, which MLX reinterprets (`view`) and widens to float32 exactly:

| format   | float16 bits built from code c                | value                      |
|----------|-----------------------------------------------|----------------------------|
| e5m2     | `c << 8` (the top byte of a float16)          | as is (inf, NaN included)  |
| e4m3fn   | sign `(c & 0x80) << 8` OR `(c & 0x7f) << 7`: exponent field 0eeee, mantissa mmm0000000 | times 2^8 (bias 15 vs 7; subnormals line up too: 2^-14 vs 2^-6); `c & 0x7f == 0x7f` NaN |
| int8     | (none)                                        | the integer, `astype`      |

then times the scale: `[]` everywhere, `[Hkv]` per KV head, `[P, Hkv, ps]` taken with the
codes' own pages.
"""

from __future__ import annotations

import mlx.core as mx

from contract import ScorePipeline


def _gather(pages, table_row, n_pages, ctx):
    """[Hkv, ctx, D]: the request's first ctx positions in logical order."""
    picked = mx.take(pages, table_row[:n_pages], axis=0)  # [n_pages, Hkv, ps, D]
    n, hkv, ps, d = picked.shape
    return picked.transpose(1, 0, 2, 3).reshape(hkv, n * ps, d)[:, :ctx, :]


def decode(codes, kv_dtype: str) -> mx.array:
    """float32 values of the codes (uint8 bit patterns for fp8, int8 for int8), unscaled."""
    if codes.dtype != (mx.int8 if kv_dtype == "int8" else mx.uint8):
        raise ValueError(f"{kv_dtype} pages hold {'int8' if kv_dtype == 'int8' else 'uint8'} codes, got {codes.dtype}")
    if kv_dtype == "int8":
        return codes.astype(mx.float32)
    c = codes.astype(mx.uint16)
    if kv_dtype == "float8_e5m2":
        return (c << 8).view(mx.float16).astype(mx.float32)
    if kv_dtype == "float8_e4m3fn":
        half = ((c & 0x80) << 8) | ((c & 0x7F) << 7)
        value = half.view(mx.float16).astype(mx.float32) * 256.0
        return mx.where((c & 0x7F) == 0x7F, mx.nan, value)
    raise ValueError(f"unknown kv_dtype {kv_dtype!r}")


def _gather_scale(scale, table_row, n_pages, ctx, pages_shape):
    """The scale of each gathered element, broadcastable to `[Hkv, ctx, D]`."""
    s = mx.array(1.0 if scale is None else scale).astype(mx.float32)
    P, hkv, ps = pages_shape[:3]
    if s.ndim == 0:
        return s
    if s.shape == (hkv,):
        return s[:, None, None]
    if s.shape == (P, hkv, ps):
        picked = mx.take(s, table_row[:n_pages], axis=0)  # [n_pages, Hkv, ps]: the physical slots
        return picked.transpose(1, 0, 2).reshape(hkv, n_pages * ps)[:, :ctx, None]
    raise ValueError(f"a scale must have shape [], [Hkv] or [P, Hkv, ps], got {list(s.shape)}")


def _gather_values(pages, table_row, n_pages, ctx, kv_dtype, scale):
    """[Hkv, ctx, D] float32: the request's keys or values, decoded and scaled when quantized."""
    picked = _gather(pages, table_row, n_pages, ctx)
    if kv_dtype is None:
        return picked.astype(mx.float32)
    return decode(picked, kv_dtype) * _gather_scale(scale, table_row, n_pages, ctx, pages.shape)


def _per_head(x):
    return None if x is None else mx.array(x).astype(mx.float32)[:, None, None]  # [Hq, 1, 1]


def attention(query, key_pages, value_pages, block_table, context_lens, page_size, **options):
    opts = ScorePipeline.of(options)
    B, Hq, L, Dk = query.shape
    Hkv, Dv = key_pages.shape[1], value_pages.shape[-1]
    group = Hq // Hkv
    scale = Dk ** -0.5 if opts.scale is None else opts.scale
    slopes, sinks = _per_head(opts.alibi_slopes), _per_head(opts.sinks)
    rows, lses = [], []
    for b in range(B):
        ctx = context_lens[b].item()
        if ctx == 0:  # an empty slot: zeros, lse -inf (its sink ignored)
            rows.append(mx.zeros((Hq, L, Dv), dtype=mx.float32))
            lses.append(mx.full((Hq, L), -mx.inf, dtype=mx.float32))
            continue
        n_pages = -(-ctx // page_size)
        k = _gather_values(key_pages, block_table[b], n_pages, ctx, opts.kv_dtype, opts.k_scale)
        v = _gather_values(value_pages, block_table[b], n_pages, ctx, opts.kv_dtype, opts.v_scale)
        k = mx.repeat(k, group, axis=0)  # query head h reads KV head h // group
        v = mx.repeat(v, group, axis=0)
        q = query[b].astype(mx.float32)  # [Hq, L, Dk]
        scores = (q @ k.transpose(0, 2, 1)) * scale  # [Hq, L, ctx]
        if opts.softcap is not None:
            cap = float(opts.softcap)
            scores = cap * mx.tanh(scores / cap)
        pos = mx.arange(ctx - L, ctx)[:, None]  # absolute position of each query row
        key = mx.arange(ctx)[None, :]
        if slopes is not None:
            scores = scores + slopes * (key - pos).astype(mx.float32)
        if opts.mask is not None:
            seen = key <= pos
            if opts.window is not None:
                seen = seen & (key > pos - opts.window)
            scores = mx.where(seen, scores, -mx.inf)
        m = scores.max(axis=-1, keepdims=True)
        if sinks is not None:
            m = mx.maximum(m, sinks)
        shifted = mx.exp(scores - m)
        total = shifted.sum(axis=-1, keepdims=True)
        if sinks is not None:
            total = total + mx.exp(sinks - m)
        weights = shifted / total
        rows.append(weights @ v)
        lses.append((m + mx.log(total))[..., 0])
    if not rows:  # B = 0: an empty batch, nothing to stack
        out, lse = mx.zeros((B, Hq, L, Dv), dtype=query.dtype), mx.zeros((B, Hq, L), dtype=mx.float32)
    else:
        out, lse = mx.stack(rows).astype(query.dtype), mx.stack(lses)
    return (out, lse) if opts.return_lse else out
