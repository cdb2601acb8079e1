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

Quantized pages (contract/kv_format.py): SDPA takes no codes and no scales, and the
dequantized values (a code times a float32 scale) are in general not representable in a
half type, so each page is decoded here to float32 and SDPA runs in float32 with the
query widened (exactly), its output cast once to the query's dtype; the mask and sinks
are then float32 and always exact. The decode, page by page with that page's scale
(`[]`, `[Hkv]` per KV head, `[P, Hkv, ps]` at the page's own slots):

| format   | decode(c)                                                                  |
|----------|----------------------------------------------------------------------------|
| e4m3fn   | `mx.from_fp8(c, float32)` (MLX's own e4m3 converter)                       |
| e5m2     | float arithmetic on the fields: e = (c // 4) % 32, m = c % 4; m * 2^-16 (e = 0), (4 + m) * 2^(e - 17), inf / NaN (e = 31); negated for c >= 128 |
| int8     | the integer, `astype`                                                      |
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


def decode(codes: mx.array, kv_dtype: str) -> mx.array:
    """float32 values of the codes (uint8 bit patterns for fp8, int8 for int8), unscaled."""
    if codes.dtype != (mx.int8 if kv_dtype == "int8" else mx.uint8):
        raise ValueError(f"{kv_dtype} pages hold {'int8' if kv_dtype == 'int8' else 'uint8'} codes, got {codes.dtype}")
    if kv_dtype == "int8":
        return codes.astype(mx.float32)
    if kv_dtype == "float8_e4m3fn":
        return mx.from_fp8(codes, mx.float32)
    if kv_dtype != "float8_e5m2":
        raise ValueError(f"unknown kv_dtype {kv_dtype!r}")
    c = codes.astype(mx.int32)
    e, m = (c // 4) % 32, (c % 4).astype(mx.float32)
    normal = (m + 4.0) * mx.power(mx.array(2.0), (e - 17).astype(mx.float32))
    magnitude = mx.where(e == 0, m * 2.0 ** -16, normal)
    magnitude = mx.where(e == 31, mx.where(m == 0, mx.inf, mx.nan), magnitude)
    return mx.where(c >= 128, -magnitude, magnitude)


def _page_values(pages: mx.array, p: int, kv_dtype: str | None, scale) -> mx.array:
    """Page p as `[Hkv, ps, D]`: as stored, or decoded and scaled to float32."""
    if kv_dtype is None:
        return pages[p]
    s = mx.array(1.0 if scale is None else scale).astype(mx.float32)
    P, hkv, ps = pages.shape[:3]
    if s.shape == (hkv,):
        s = s[:, None, None]
    elif s.shape == (P, hkv, ps):
        s = s[p][..., None]
    elif s.ndim != 0:
        raise ValueError(f"a scale must have shape [], [Hkv] or [P, Hkv, ps], got {list(s.shape)}")
    return decode(pages[p], kv_dtype) * s


def attention(query, key_pages, value_pages, block_table, context_lens, page_size, **options) -> mx.array:
    opts = ScorePipeline.of(options)
    if opts.softcap is not None:
        raise NotApplicable("soft-cap: mx.fast.scaled_dot_product_attention applies no function to the scores")
    if opts.return_lse:
        raise NotApplicable("LSE: mx.fast.scaled_dot_product_attention returns the output only")
    B, Hq, L, D = query.shape
    Dv = value_pages.shape[-1]
    scale = D ** -0.5 if opts.scale is None else opts.scale
    kv = opts.kv
    compute = mx.float32 if kv.quantized else query.dtype  # SDPA's dtype: K/V's
    sinks = None
    if opts.sinks is not None:
        sinks = _in_dtype(mx.array(opts.sinks).astype(mx.float32), compute, "sinks")
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
        k = mx.concatenate([_page_values(key_pages, p, kv.dtype, kv.k_scale) for p in pages], axis=1)
        v = mx.concatenate([_page_values(value_pages, p, kv.dtype, kv.v_scale) for p in pages], axis=1)
        k, v = k[None, :, :ctx], v[None, :, :ctx]
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
            mask = _in_dtype(bias, compute, "ALiBi biases")[None]
        q = query[b:b + 1].astype(compute)
        outs.append(mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, sinks=sinks)[0]
                    .astype(query.dtype))
    return mx.stack(outs) if outs else mx.zeros((B, Hq, L, Dv), dtype=query.dtype)  # B = 0: empty
