"""Oracle (d): float64 NumPy reference, written straight from the contract.

No MLX here, no shared helper with impl/ or the other oracles: each key is found with
the addressing formula itself, `pages[block_table[b, j // page_size], g, j % page_size]`,
and each query row is reduced over exactly the keys it may see. The score pipeline
(contract/pipeline.py) is applied row by row in float64, in its order: scale, soft-cap
`c * tanh(s / c)` (NumPy's tanh saturates to +-1, it never overflows), ALiBi
`slope_h * (j - p)`, mask (only visible keys are taken), then the softmax with the sink
logit `sigma_h` in its max and its denominator only.
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


def attention_f64(query, key_pages, value_pages, block_table, context_lens, page_size, **options):
    """Returns float64 `[B, Hq, L, Dv]`, or `(out, lse)` with `return_lse=True` (lse float64
    `[B, Hq, L]`, natural log, `-inf` on an empty slot); inputs are array-likes (any float dtype)."""
    opts = ScorePipeline.of(options)
    q = np.asarray(query, dtype=np.float64)
    kp = np.asarray(key_pages, dtype=np.float64)
    vp = np.asarray(value_pages, dtype=np.float64)
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
