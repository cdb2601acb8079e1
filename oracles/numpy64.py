"""Oracle (d): float64 NumPy reference, written straight from the contract.

No MLX here, no shared helper with impl/ or the other oracles: each key is found with
the addressing formula itself, `pages[block_table[b, j // page_size], g, j % page_size]`,
and each query row is reduced over exactly the keys it may see.
"""

from __future__ import annotations

import numpy as np


def visible_keys(ctx: int, L: int, l: int, causal: bool, window: int | None) -> np.ndarray:
    """Absolute key positions query row l of a request with ctx positions sees."""
    if not causal:
        return np.arange(ctx)
    p = ctx - L + l
    first = 0 if window is None else max(0, p - window + 1)
    return np.arange(first, p + 1)


def attention_f64(query, key_pages, value_pages, block_table, context_lens, page_size, *,
                  scale=None, mask="causal", window=None) -> np.ndarray:
    """Returns float64 `[B, Hq, L, D]`; inputs are array-likes (any float dtype)."""
    q = np.asarray(query, dtype=np.float64)
    kp = np.asarray(key_pages, dtype=np.float64)
    vp = np.asarray(value_pages, dtype=np.float64)
    table = np.asarray(block_table)
    lens = np.asarray(context_lens)
    B, Hq, L, D = q.shape
    Hkv = kp.shape[1]
    group = Hq // Hkv
    scale = D ** -0.5 if scale is None else float(scale)
    out = np.zeros((B, Hq, L, D), dtype=np.float64)
    for b in range(B):
        ctx = int(lens[b])
        if ctx == 0:
            continue
        for h in range(Hq):
            g = h // group
            for l in range(L):
                j = visible_keys(ctx, L, l, mask is not None, window)
                pages = table[b, j // page_size]
                keys = kp[pages, g, j % page_size, :]
                values = vp[pages, g, j % page_size, :]
                s = keys @ q[b, h, l] * scale
                w = np.exp(s - s.max())
                out[b, h, l] = (w / w.sum()) @ values
    return out
