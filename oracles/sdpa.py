"""Oracle (c): MLX's fused `scaled_dot_product_attention` on per-request gathered K/V.

The gather reads the block table on the host and concatenates the request's pages;
the mask is an explicit boolean matrix, so no alignment convention of MLX's "causal"
string is assumed.
"""

from __future__ import annotations

import mlx.core as mx


def attention(query, key_pages, value_pages, block_table, context_lens, page_size, *,
              scale=None, mask="causal", window=None) -> mx.array:
    B, Hq, L, D = query.shape
    scale = D ** -0.5 if scale is None else scale
    table = block_table.tolist()
    lens = context_lens.tolist()
    outs = []
    for b in range(B):
        ctx = lens[b]
        if ctx == 0:
            outs.append(mx.zeros((Hq, L, D), dtype=query.dtype))
            continue
        pages = table[b][: -(-ctx // page_size)]
        k = mx.concatenate([key_pages[p] for p in pages], axis=1)[None, :, :ctx]
        v = mx.concatenate([value_pages[p] for p in pages], axis=1)[None, :, :ctx]
        allowed = None
        if mask is not None:
            row = mx.arange(ctx - L, ctx)[:, None]
            col = mx.arange(ctx)[None, :]
            allowed = col <= row
            if window is not None:
                allowed = allowed & (col > row - window)
        outs.append(mx.fast.scaled_dot_product_attention(query[b:b + 1], k, v, scale=scale, mask=allowed)[0])
    return mx.stack(outs) if outs else mx.zeros(query.shape, dtype=query.dtype)  # B = 0: empty
