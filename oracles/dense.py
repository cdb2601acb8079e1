"""Oracle (b): gather every request into padded dense K/V, then batched dense attention.

`dense_gather` is also the control a paged kernel must beat (bench/ times it): one
vectorized gather through the whole block table, positions past a request's context
zeroed so that garbage (NaN) in unused slots cannot reach the output through 0 * NaN.
"""

from __future__ import annotations

import mlx.core as mx


def dense_gather(key_pages, value_pages, block_table, context_lens, page_size):
    """Returns (K, V, valid): K/V `[B, Hkv, S, D]` with S = pages * page_size, valid `[B, S]`."""
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


def dense_attention(query, keys, values, context_lens, *, scale=None, mask="causal", window=None):
    """Batched attention over padded dense K/V; query head h reads KV head h // (Hq // Hkv)."""
    B, Hq, L, D = query.shape
    Hkv, S = keys.shape[1], keys.shape[2]
    scale = D ** -0.5 if scale is None else scale
    q = query.astype(mx.float32).reshape(B, Hkv, Hq // Hkv, L, D)
    k = keys.astype(mx.float32)[:, :, None]
    v = values.astype(mx.float32)[:, :, None]
    scores = (q @ k.swapaxes(-1, -2)) * scale  # [B, Hkv, G, L, S]
    key = mx.arange(S)[None, None, :]
    ctx = context_lens[:, None, None]
    seen = key < ctx
    if mask is not None:
        pos = ctx - L + mx.arange(L)[None, :, None]
        seen = seen & (key <= pos)
        if window is not None:
            seen = seen & (key > pos - window)
    scores = mx.where(seen[:, None, None], scores, -mx.inf)
    weights = mx.softmax(scores, axis=-1, precise=True)
    out = (weights @ v).reshape(B, Hq, L, D)
    out = mx.where((context_lens > 0)[:, None, None, None], out, 0.0)  # empty slots: 0, not NaN
    return out.astype(query.dtype)


def attention(query, key_pages, value_pages, block_table, context_lens, page_size, *,
              scale=None, mask="causal", window=None) -> mx.array:
    keys, values, _ = dense_gather(key_pages, value_pages, block_table, context_lens, page_size)
    return dense_attention(query, keys, values, context_lens, scale=scale, mask=mask, window=window)
