"""The Triton kernels: split-KV decode, its merge, and the tiled prefill.

Both schedules read pagecheck's own layout (pools `[P, Hkv, ps, D]`, queries `[B, Hq, L, D]`,
a padded `block_table`) and share one tile step, `_attend_tile`: page-resolved K and V tiles,
`tl.dot` scores, the score pipeline (soft-cap, ALiBi), the mask, an online softmax in base 2.

| kernel               | grid                                   | job |
|----------------------|----------------------------------------|-----|
| `decode_split_kernel`| (request, KV head, context split)      | the whole GQA group's L <= 8 rows against one split: every K/V tile loaded once for the group; writes the split's partial state (m, l, o) |
| `merge_kernel`       | (request, query head)                  | folds the request's splits in split order 0, 1, ... (a request's split count depends on its own context length only, so its bits do not depend on the batch), adds the sink, writes out and lse |
| `prefill_kernel`     | (request, query head, BLOCK_M rows)    | BLOCK_M query rows x BLOCK_N keys; tiles above the causal diagonal or below the window skipped wholesale |

Numerics: scores and states in float32. The scale and log2(e) are one multiplier, `qk_log2`,
applied to the gap to the running max (the state's max stays in the logits' own units; the
lse leaves as a natural log). `tl.dot` on float32 is asked for
IEEE precision (tf32 would keep 10 mantissa bits); on 16-bit inputs the weights go to the
value dtype for the second dot (as FlashAttention does: error of the weights about 2^-9
relative in bfloat16). `DOT_F32` runs both dots in float32 on the same rounded inputs:
the Triton interpreter's bfloat16 `tl.dot` multiplies bit patterns (triton #11584), so the
interpreter runs bf16 this way, with the weights still rounded to bfloat16 first: the
same arithmetic a GPU does, summed in float32.

Unread data is never touched: a K or V tile is a masked load (keys at or past the context
length read 0, never the NaN a tail slot may hold) and page ids past the request's pages are
never loaded. A page id outside the pool is never dereferenced either: its keys load as 0
and make NaN the rows that see them (metadata is checked before a call, gpu/checks.py; this
is the net under it, as the interpreter does not bounds-check); `tl.device_assert` fires
first in a debug build (TRITON_DEBUG=1).
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # for the host (gpu/paged.py folds it into the scale)
LN2 = 0.6931471805599453
# inside kernels: a compiled kernel may read a global only as a constexpr (the
# interpreter reads any, so only the sm_90 compile, gpu/compile.py, catches a plain one)
_LOG2E = tl.constexpr(LOG2E)
_LN2 = tl.constexpr(LN2)


@triton.jit
def _tanh(x):
    """tanh without e^x of a positive argument (overflow to inf/inf): e^(-2|x|) past 0.625,
    Cephes' tanhf odd polynomial below (no cancellation); the same split as impl/csrc/logits.h."""
    z = tl.abs(x)
    e = tl.exp2(z * -2.8853900817779268)
    far = (1.0 - e) / (1.0 + e)
    z2 = z * z
    p = -5.70498872745e-3 * z2 + 2.06390887954e-2
    p = p * z2 - 5.37397155531e-2
    p = p * z2 + 1.33314422036e-1
    p = p * z2 - 3.33332819422e-1
    near = p * z2 * z + z
    t = tl.where(z > 0.625, far, near)
    return tl.where(x < 0, -t, t)


@triton.jit
def _mma(a, b, DOT_F32: tl.constexpr):
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _attend_tile(q, m_i, l_i, acc, start, hi, b, g, pos, row_ok, slope,
                 K, V, BT, num_pages, s_kp, s_kh, s_ks, s_vp, s_vh, s_vs, s_bt,
                 scale, qk_log2, softcap, window,
                 PS: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
                 CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                 HAS_ALIBI: tl.constexpr, DOT_F32: tl.constexpr, PAGE_TILES: tl.constexpr):
    """One BLOCK_N tile of keys [start, start + BLOCK_N) for the rows `pos` (absolute
    positions): returns the online-softmax state (m, l, acc) with the tile folded in."""
    j = start + tl.arange(0, BLOCK_N)
    kv_ok = j < hi
    if PAGE_TILES:  # BLOCK_N divides the page size: the whole tile lies in one page
        page = tl.load(BT + b * s_bt + start // PS).to(tl.int64)
        slot = (start % PS) + tl.arange(0, BLOCK_N)
    else:  # a tile may cross pages: one page id per key
        page = tl.load(BT + b * s_bt + j // PS, mask=kv_ok, other=0).to(tl.int64)
        slot = j % PS
    # A page id outside the pool is never dereferenced: its keys load as 0 and the rows
    # that see them turn NaN below (the interpreter does not bounds-check; a GPU traps on
    # it only in debug builds, where the assert fires first).
    page_ok = (page >= 0) & (page < num_pages)
    tl.device_assert(page_ok | ~kv_ok, "block_table names a page outside the pool")
    kv_ok_read = kv_ok & page_ok
    k_row = page * s_kp + slot * s_ks
    v_row = page * s_vp + slot * s_vs
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    k = tl.load(K + g * s_kh + k_row[None, :] + dk[:, None], mask=kv_ok_read[None, :] & (dk < DK)[:, None],
                other=0.0)
    t = _mma(q, k, DOT_F32)  # raw scores; logits in t's units are t * qk_log2 in base 2
    if HAS_SOFTCAP or HAS_ALIBI:  # natural-log logits first (qk_log2 is then log2(e))
        t = t * scale
        if HAS_SOFTCAP:
            t = softcap * _tanh(t / softcap)
        if HAS_ALIBI:
            t += slope[:, None] * (j[None, :] - pos[:, None]).to(tl.float32)
    visible = kv_ok[None, :] & row_ok[:, None]
    if CAUSAL:
        visible = visible & (j[None, :] <= pos[:, None])
    if HAS_WINDOW:
        visible = visible & (j[None, :] > pos[:, None] - window)
    t = tl.where(visible, t, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(t, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that saw nothing yet: no -inf - -inf
    # The max is subtracted before the multiply: (t - m) * qk_log2 errs relative to the gap,
    # t * qk_log2 - m * qk_log2 by the ulp of the logit itself (7e-4 at a logit of 1e4).
    p = tl.exp2((t - m_use[:, None]) * qk_log2)
    alpha = tl.exp2((m_i - m_use) * qk_log2)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(V + g * s_vh + v_row[:, None] + dv[None, :], mask=kv_ok_read[:, None] & (dv < DV)[None, :],
                other=0.0)
    # A key hidden from some rows of the tile (the diagonal, a window edge) still meets
    # them in the P.V product as 0 * v: a NaN or inf there would poison them. Non-finite
    # values go in as 0, and only the rows that see such a key (or a key of a page outside
    # the pool) are made NaN.
    bad = (v != v) | (tl.abs(v.to(tl.float32)) == float("inf"))
    bad_key = (tl.max(bad.to(tl.int32), 1) > 0) | ~page_ok
    poisoned = tl.max((visible & bad_key[None, :]).to(tl.int32), 1) > 0
    v = tl.where(bad, 0.0, v).to(V.dtype.element_ty)
    acc = acc * alpha[:, None] + _mma(p.to(v.dtype), v, DOT_F32)
    acc = tl.where(poisoned[:, None], float("nan"), acc)
    return m_new, l_i, acc


@triton.jit
def decode_split_kernel(Q, K, V, BT, CTX, Slopes, OP, MP, LP, num_pages,
                        s_qb, s_qh, s_ql, s_kp, s_kh, s_ks, s_vp, s_vh, s_vs, s_bt,
                        scale, qk_log2, softcap, window, NS,
                        HQ: tl.constexpr, L: tl.constexpr, G: tl.constexpr,
                        MIN_SPLIT: tl.constexpr, PS: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr,
                        BLOCK_DV: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                        HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, DOT_F32: tl.constexpr,
                        PAGE_TILES: tl.constexpr):
    b = tl.program_id(0)
    g = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(CTX + b)
    n_splits = tl.minimum(tl.cdiv(ctx, MIN_SPLIT), NS)  # this request's own count
    if split < n_splits:
        split_len = tl.cdiv(tl.cdiv(ctx, n_splits), BLOCK_N) * BLOCK_N
        lo = split * split_len
        hi = tl.minimum(ctx, lo + split_len)
        if HAS_WINDOW:  # the oldest key any row of the group sees, on the tile grid
            lo = tl.maximum(lo, tl.maximum(ctx - L - window + 1, 0) // BLOCK_N * BLOCK_N)
        rows = tl.arange(0, BLOCK_M)
        row_ok = rows < G * L
        head = g * G + rows // L  # contiguous GQA groups: head h reads KV head h // G
        ql = rows % L
        pos = ctx - L + ql
        dk = tl.arange(0, BLOCK_DK)
        q = tl.load(Q + b * s_qb + head[:, None] * s_qh + ql[:, None] * s_ql + dk[None, :],
                    mask=row_ok[:, None] & (dk < DK)[None, :], other=0.0)
        slope = tl.load(Slopes + head, mask=row_ok, other=0.0) if HAS_ALIBI else 0.0
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
        for start in range(lo, hi, BLOCK_N):
            m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, start, hi, b, g, pos, row_ok, slope,
                                         K, V, BT, num_pages, s_kp, s_kh, s_ks, s_vp, s_vh, s_vs, s_bt,
                                         scale, qk_log2, softcap, window, PS, DK, DV, BLOCK_N, BLOCK_DK, BLOCK_DV,
                                         CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, DOT_F32, PAGE_TILES)
        # partial state of (request, head, row, split): contiguous [B, Hq, L, NS(, DV)]
        state = ((b * HQ + head) * L + ql) * NS + split
        tl.store(MP + state, m_i, mask=row_ok)
        tl.store(LP + state, l_i, mask=row_ok)
        dv = tl.arange(0, BLOCK_DV)
        tl.store(OP + state[:, None] * DV + dv[None, :], acc, mask=row_ok[:, None] & (dv < DV)[None, :])


@triton.jit
def _finish(O, LSE, b, h, rows, row_ok, m_i, l_i, acc, ctx, Sinks, qk_log2, s_ob, s_oh, s_ol, HQ: tl.constexpr,
            L, DV: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_SINKS: tl.constexpr,
            WRITE_LSE: tl.constexpr):
    """The sink (once per row, never scaled), the division, the cast, the lse (natural log);
    m_i in the logits' units (times qk_log2: base 2)."""
    m2 = m_i * qk_log2
    if HAS_SINKS:
        sink = tl.where(ctx > 0, tl.load(Sinks + h) * _LOG2E, float("-inf"))  # an empty slot has no sink
        m_new = tl.maximum(m2, sink)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m2 - m_use)
        l_i = l_i * alpha + tl.exp2(sink - m_use)
        acc = acc * alpha[:, None]
        m2 = m_new
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]  # an empty slot: zeros
    dv = tl.arange(0, BLOCK_DV)
    tl.store(O + b * s_ob + h * s_oh + rows[:, None] * s_ol + dv[None, :], out.to(O.dtype.element_ty),
             mask=row_ok[:, None] & (dv < DV)[None, :])
    if WRITE_LSE:
        lse = tl.where(seen, (m2 + tl.log2(tl.where(seen, l_i, 1.0))) * _LN2, float("-inf"))
        tl.store(LSE + (b * HQ + h) * L + rows, lse, mask=row_ok)


@triton.jit
def merge_kernel(OP, MP, LP, CTX, Sinks, O, LSE, qk_log2, s_ob, s_oh, s_ol, NS,
                 HQ: tl.constexpr, L: tl.constexpr, MIN_SPLIT: tl.constexpr,
                 DV: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_DV: tl.constexpr,
                 HAS_SINKS: tl.constexpr, WRITE_LSE: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    ctx = tl.load(CTX + b)
    n_splits = tl.minimum(tl.cdiv(ctx, MIN_SPLIT), NS)
    rows = tl.arange(0, BLOCK_L)
    row_ok = rows < L
    dv = tl.arange(0, BLOCK_DV)
    m_i = tl.full([BLOCK_L], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_L], tl.float32)
    acc = tl.zeros([BLOCK_L, BLOCK_DV], tl.float32)
    for split in range(0, n_splits):  # split order, the request's own count: batch-independent bits
        state = ((b * HQ + h) * L + rows) * NS + split
        m_s = tl.load(MP + state, mask=row_ok, other=float("-inf"))
        l_s = tl.load(LP + state, mask=row_ok, other=0.0)
        o_s = tl.load(OP + state[:, None] * DV + dv[None, :], mask=row_ok[:, None] & (dv < DV)[None, :], other=0.0)
        m_new = tl.maximum(m_i, m_s)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2((m_i - m_use) * qk_log2)
        beta = tl.exp2((m_s - m_use) * qk_log2)
        l_i = l_i * alpha + l_s * beta
        acc = acc * alpha[:, None] + o_s * beta[:, None]
        m_i = m_new
    _finish(O, LSE, b, h, rows, row_ok, m_i, l_i, acc, ctx, Sinks, qk_log2, s_ob, s_oh, s_ol, HQ, L, DV,
            BLOCK_DV, HAS_SINKS, WRITE_LSE)


@triton.jit
def prefill_kernel(Q, K, V, BT, CTX, Slopes, Sinks, O, LSE, num_pages,
                   s_qb, s_qh, s_ql, s_kp, s_kh, s_ks, s_vp, s_vh, s_vs, s_bt, s_ob, s_oh, s_ol,
                   scale, qk_log2, softcap, window, L,
                   HQ: tl.constexpr, G: tl.constexpr, PS: tl.constexpr,
                   DK: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, CAUSAL: tl.constexpr,
                   HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
                   HAS_SINKS: tl.constexpr, WRITE_LSE: tl.constexpr, DOT_F32: tl.constexpr,
                   PAGE_TILES: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    first = tl.program_id(2) * BLOCK_M
    ctx = tl.load(CTX + b)
    g = h // G
    rows = first + tl.arange(0, BLOCK_M)
    row_ok = rows < L
    pos = ctx - L + rows
    hi = ctx
    lo = 0
    if CAUSAL:  # tiles past the block's last row: skipped wholesale
        hi = tl.minimum(ctx, ctx - L + first + BLOCK_M)
    if HAS_WINDOW:  # tiles before the block's first row's window: skipped wholesale
        lo = tl.maximum(ctx - L + first - window + 1, 0) // BLOCK_N * BLOCK_N
    dk = tl.arange(0, BLOCK_DK)
    q = tl.load(Q + b * s_qb + h * s_qh + rows[:, None] * s_ql + dk[None, :],
                mask=row_ok[:, None] & (dk < DK)[None, :], other=0.0)
    slope = tl.load(Slopes + h) if HAS_ALIBI else 0.0
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    slopes = tl.zeros([BLOCK_M], tl.float32) + slope
    for start in range(lo, hi, BLOCK_N):
        m_i, l_i, acc = _attend_tile(q, m_i, l_i, acc, start, hi, b, g, pos, row_ok, slopes,
                                     K, V, BT, num_pages, s_kp, s_kh, s_ks, s_vp, s_vh, s_vs, s_bt,
                                     scale, qk_log2, softcap, window, PS, DK, DV, BLOCK_N, BLOCK_DK, BLOCK_DV,
                                     CAUSAL, HAS_WINDOW, HAS_SOFTCAP, HAS_ALIBI, DOT_F32, PAGE_TILES)
    _finish(O, LSE, b, h, rows, row_ok, m_i, l_i, acc, ctx, Sinks, qk_log2, s_ob, s_oh, s_ol, HQ, L, DV,
            BLOCK_DV, HAS_SINKS, WRITE_LSE)
