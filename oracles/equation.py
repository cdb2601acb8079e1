"""Oracle (a): the attention equation in mlx.core, one request at a time.

K/V are gathered through the block table with `mx.take`, then the textbook steps are
spelled out: scores, mask, softmax (max-shifted exp over its sum), weighted sum, all
in float32, the result cast once to the query's dtype.
"""

from __future__ import annotations

import mlx.core as mx


def _gather(pages, table_row, n_pages, ctx):
    """[Hkv, ctx, D]: the request's first ctx positions in logical order."""
    picked = mx.take(pages, table_row[:n_pages], axis=0)  # [n_pages, Hkv, ps, D]
    n, hkv, ps, d = picked.shape
    return picked.transpose(1, 0, 2, 3).reshape(hkv, n * ps, d)[:, :ctx, :]


def attention(query, key_pages, value_pages, block_table, context_lens, page_size, *,
              scale=None, mask="causal", window=None) -> mx.array:
    B, Hq, L, D = query.shape
    Hkv = key_pages.shape[1]
    group = Hq // Hkv
    scale = D ** -0.5 if scale is None else scale
    rows = []
    for b in range(B):
        ctx = context_lens[b].item()
        if ctx == 0:
            rows.append(mx.zeros((Hq, L, D), dtype=mx.float32))
            continue
        n_pages = -(-ctx // page_size)
        k = _gather(key_pages, block_table[b], n_pages, ctx).astype(mx.float32)
        v = _gather(value_pages, block_table[b], n_pages, ctx).astype(mx.float32)
        k = mx.repeat(k, group, axis=0)  # query head h reads KV head h // group
        v = mx.repeat(v, group, axis=0)
        q = query[b].astype(mx.float32)  # [Hq, L, D]
        scores = (q @ k.transpose(0, 2, 1)) * scale  # [Hq, L, ctx]
        if mask is not None:
            pos = mx.arange(ctx - L, ctx)[:, None]  # absolute position of each query row
            key = mx.arange(ctx)[None, :]
            seen = key <= pos
            if window is not None:
                seen = seen & (key > pos - window)
            scores = mx.where(seen, scores, -mx.inf)
        shifted = mx.exp(scores - scores.max(axis=-1, keepdims=True))
        weights = shifted / shifted.sum(axis=-1, keepdims=True)
        rows.append(weights @ v)
    if not rows:  # B = 0: an empty batch, nothing to stack
        return mx.zeros((B, Hq, L, D), dtype=query.dtype)
    return mx.stack(rows).astype(query.dtype)
