"""Oracle (c): MLX's fused `scaled_dot_product_attention` on per-request gathered K/V.

The gather reads the block table on the host and concatenates the request's pages;
the mask is an explicit boolean matrix, so no alignment convention of MLX's "causal"
string is assumed.

What MLX 0.32.4's SDPA can express (its `mlx/fast.cpp`; checked on this build):

| feature   | how                                                                       |
|-----------|---------------------------------------------------------------------------|
| Dk != Dv  | native: only q and k must share the last dim; out takes v's               |
| ALiBi     | an additive float mask `slope_h * (j - p)`, `-inf` where masked            |
| sinks     | `sinks=` `[Hq]`: a column of logits in the softmax, dropped before `@ V`   |
| soft-cap  | no: nothing applies a function to the scores -> `NotApplicable`            |
| LSE       | no: the Python call returns the output only -> `NotApplicable`             |

An additive mask and the sinks must be in the query's dtype (MLX: "must promote to
output type"), so for float16 / bfloat16 they are passed rounded to that dtype only when
the rounding is exact; otherwise SDPA would answer a different call, and it says
`NotApplicable` instead.
"""

from __future__ import annotations

import mlx.core as mx

from contract import ScorePipeline

from . import NotApplicable


def _in_dtype(x: mx.array, dtype, what: str) -> mx.array:
    """float32 `x` in the query's dtype, when that is exact."""
    if dtype == mx.float32:
        return x
    rounded = x.astype(dtype)
    if not mx.array_equal(rounded.astype(mx.float32), x, equal_nan=True).item():
        raise NotApplicable(f"{what} not exactly representable in {dtype}: MLX SDPA takes them only in "
                            "the query's dtype")
    return rounded


def attention(query, key_pages, value_pages, block_table, context_lens, page_size, **options) -> mx.array:
    opts = ScorePipeline.of(options)
    if opts.softcap is not None:
        raise NotApplicable("soft-cap: mx.fast.scaled_dot_product_attention applies no function to the scores")
    if opts.return_lse:
        raise NotApplicable("LSE: mx.fast.scaled_dot_product_attention returns the output only")
    B, Hq, L, D = query.shape
    Dv = value_pages.shape[-1]
    scale = D ** -0.5 if opts.scale is None else opts.scale
    sinks = None
    if opts.sinks is not None:
        sinks = _in_dtype(mx.array(opts.sinks).astype(mx.float32), query.dtype, "sinks")
    slopes = None if opts.alibi_slopes is None else mx.array(opts.alibi_slopes).astype(mx.float32)[:, None, None]
    table = block_table.tolist()
    lens = context_lens.tolist()
    outs = []
    for b in range(B):
        ctx = lens[b]
        if ctx == 0:  # an empty slot: zeros, its sink ignored
            outs.append(mx.zeros((Hq, L, Dv), dtype=query.dtype))
            continue
        pages = table[b][: -(-ctx // page_size)]
        k = mx.concatenate([key_pages[p] for p in pages], axis=1)[None, :, :ctx]
        v = mx.concatenate([value_pages[p] for p in pages], axis=1)[None, :, :ctx]
        row = mx.arange(ctx - L, ctx)[:, None]
        col = mx.arange(ctx)[None, :]
        allowed = None
        if opts.mask is not None:
            allowed = col <= row
            if opts.window is not None:
                allowed = allowed & (col > row - opts.window)
        mask = allowed
        if slopes is not None:  # ALiBi as an additive mask [Hq, L, ctx], -inf where not allowed
            bias = slopes * (col - row).astype(mx.float32)
            if allowed is not None:
                bias = mx.where(allowed, bias, -mx.inf)
            mask = _in_dtype(bias, query.dtype, "ALiBi biases")[None]
        outs.append(mx.fast.scaled_dot_product_attention(query[b:b + 1], k, v, scale=scale, mask=mask,
                                                         sinks=sinks)[0])
    return mx.stack(outs) if outs else mx.zeros((B, Hq, L, Dv), dtype=query.dtype)  # B = 0: empty
