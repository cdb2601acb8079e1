"""Oracle (a): the attention equation in mlx.core, one request at a time.

K/V are gathered through the block table with `mx.take`, then the textbook steps are
spelled out: scores, soft-cap (`c * tanh(s / c)`: MLX's tanh saturates, no exp), ALiBi
bias, mask, softmax (max-shifted exp over its sum, the sink's `e^(sigma - m)` added to
the sum and `sigma` to the max), weighted sum, LSE `m + log(sum)`, all in float32, the
output cast once to the query's dtype.
"""

from __future__ import annotations

import mlx.core as mx

from contract import ScorePipeline


def _gather(pages, table_row, n_pages, ctx):
    """[Hkv, ctx, D]: the request's first ctx positions in logical order."""
    picked = mx.take(pages, table_row[:n_pages], axis=0)  # [n_pages, Hkv, ps, D]
    n, hkv, ps, d = picked.shape
    return picked.transpose(1, 0, 2, 3).reshape(hkv, n * ps, d)[:, :ctx, :]


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
        k = _gather(key_pages, block_table[b], n_pages, ctx).astype(mx.float32)
        v = _gather(value_pages, block_table[b], n_pages, ctx).astype(mx.float32)
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
