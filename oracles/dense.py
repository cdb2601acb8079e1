"""Oracle (b): gather every request into padded dense K/V, then batched dense attention.

`dense_gather` is also the control a paged kernel must beat (bench/ times it): one
vectorized gather through the whole block table, positions past a request's context
zeroed so that garbage (NaN) in unused slots cannot reach the output through 0 * NaN.

The score pipeline is applied to the whole padded score block at once (cap, ALiBi
bias, mask to -inf, `mx.softmax`); a sink is not a column of it: the keys' softmax
output is rescaled by their share `d_keys / (d_keys + e^sigma) = sigmoid(lse_keys - sigma)`
and the LSE is `logaddexp(lse_keys, sigma)` (`mx.logsumexp` over the keys).
"""

from __future__ import annotations

import mlx.core as mx

from contract import ScorePipeline


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
    keys, values, _ = dense_gather(key_pages, value_pages, block_table, context_lens, page_size)
    return dense_attention(query, keys, values, context_lens, **options)
