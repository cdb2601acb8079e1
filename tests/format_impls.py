"""Kernels in foreign formats for tests/test_formats.py and tests/test_bridges.py, loaded
through `--impl tests.format_impls:NAME`.

`native_reference(fmt)` is a float64 NumPy kernel that reads its arguments in the native
format `fmt` declares, by each format's own definition (the accessors below, written
from the tables in conformance/formats, not through its converters): if the converters
and these definitions disagree, the catalog fails it. It computes contract v2 too
(soft-cap, ALiBi, sinks, the lse, Dv != Dk) and writes the lse and applies ALiBi in the
conventions `fmt` declares (`lse_convention`, `empty_lse`, `alibi_convention`, from
their definitions in conformance/formats/conventions.py's table), so the conversion
back is checked against what such a kernel really returns. Each BROKEN entry misreads
one convention the way real adapters do and names the clause the catalog must point at.

| name                       | format                                    | the defect                          | clause |
|----------------------------|-------------------------------------------|-------------------------------------|--------|
| `nhd_csr_varlen_flash`     | nhd, csr, varlen, flash                   | none                                | -      |
| `kv_hnd_flashinfer`        | kv_hnd, padded, padded, flashinfer        | none                                | -      |
| `kv_nhd_csr`               | kv_nhd, csr, padded, count                | none                                | -      |
| `kv_last_varlen`           | kv_last, padded, varlen, count            | none                                | -      |
| `vllm_split_varlen_f16`    | vllm_split, padded, varlen, count; f16/bf16 | none                              | -      |
| `flash_left_as_count`      | nhd, padded, padded, flash                | window_size[0] read as the key count | window |
| `csr_last_as_index`        | hnd, csr, padded, count                   | kv_last_page_len read as the last slot's index | oracle |
| `varlen_rows_from_start`   | hnd, padded, varlen, count                | packed rows placed at positions 0..n-1 | causal |
| `v2_nhd_varlen`            | nhd, padded, varlen, count; every v2 feature | none                             | -      |
| `v2_flashinfer_like`       | hnd, csr, padded, flashinfer; lse base 2, ALiBi before the cap | none           | -      |
| `v2_fa2_like`              | nhd, padded, padded, flash; empty lse +inf, ALiBi -slope * abs(p - j) | none    | -      |
| `v2_vllm_like`             | vllm_split, padded, varlen, count; ALiBi at j - ctx + 1 | none                  | -      |
| `quant_<layout>`           | each layout of conformance/formats/kv.py (KV_LAYOUTS), with csr, varlen, flash or flashinfer on some; every KV format and scale granularity | none | -  |

Quantized pages (every `quant_*` kernel; the others declare no KV format) are read as stored:
uint8 fp8 codes decoded through fixtures/quantized.py's table of the format, int8 as their
value, each times its scale, a per-token one indexed in the layout's slot order
(`[P, ps, Hkv]` for nhd / kv_nhd), by the table in conformance/formats/kv.py.
"""

from __future__ import annotations

import numpy as np

from conformance.bridges import from_numpy


def _rows(layout, kw, pages, slots):
    """K and V of the given (page, slot) pairs: `[n, Hkv, D]` each, float64; quantized
    pages decoded and scaled (`_dequantized`)."""
    k, v = _codes(layout, kw, pages, slots)
    if kw.get("kv_dtype") is None:
        return k, v
    return (_dequantized(layout, kw, k, kw.get("k_scale"), pages, slots),
            _dequantized(layout, kw, v, kw.get("v_scale"), pages, slots))


def _dequantized(layout, kw, codes, scale, pages, slots):
    """`decode(code) * s` by contract/kv_format.py's definition: uint8 codes are fp8 bit
    patterns (decoded by fixtures/quantized.py's table of the format), int8 codes and
    codes a torch kernel decoded itself are their value; a per-token scale is indexed in
    the layout's slot order (`[P, ps, Hkv]` for nhd / kv_nhd, else `[P, Hkv, ps]`)."""
    from fixtures.quantized import code_values

    x = codes
    if kw["raw_dtype"] == np.uint8:
        x = code_values(kw["kv_dtype"])[codes.astype(np.uint8)]
    if scale is None:
        return x
    s = np.asarray(scale, dtype=np.float64)
    if s.ndim == 1:
        return x * s[None, :, None]
    if s.ndim == 3:
        s = s[pages, slots] if layout in ("nhd", "kv_nhd") else s[pages, :, slots]
        return x * s[:, :, None]
    return x * s


def _codes(layout, kw, pages, slots):
    """The K and V elements of the given (page, slot) pairs as stored, `[n, Hkv, D]` each, float64."""
    if layout == "hnd":
        k, v = kw["key_cache"][pages, :, slots], kw["value_cache"][pages, :, slots]
    elif layout == "nhd":
        k, v = kw["key_cache"][pages, slots], kw["value_cache"][pages, slots]
    elif layout == "kv_hnd":
        k, v = kw["kv_cache"][pages, 0, :, slots], kw["kv_cache"][pages, 1, :, slots]
    elif layout == "kv_nhd":
        k, v = kw["kv_cache"][pages, 0, slots], kw["kv_cache"][pages, 1, slots]
    elif layout == "kv_last":
        d = kw["kv_cache"].shape[-1] // 2
        k, v = kw["kv_cache"][pages, :, slots, :d], kw["kv_cache"][pages, :, slots, d:]
    elif layout == "amx_packed":  # [P, Hkv, ps, D], each head's slice permuted (conformance/formats/kv.py)
        k = _packed_rows(kw["key_cache"], pages, slots, _packed_key_index)
        v = _packed_rows(kw["value_cache"], pages, slots, _packed_value_index)
    else:  # vllm_split: key [P, Hkv, D/x, ps, x], value [P, Hkv, D, ps]
        k = kw["key_cache"][pages, :, :, slots, :]
        k = k.reshape(k.shape[0], k.shape[1], k.shape[2] * k.shape[3])
        v = kw["value_cache"][pages, :, :, slots]
    return k.astype(np.float64), v.astype(np.float64)


def _packed_key_index(slot, d, D):
    """amx_packed K: (key block, d step, d pair, key, element of the pair), flattened."""
    return ((slot // 16 * (D // 32) + d // 32) * 16 + d % 32 // 2) * 32 + 2 * (slot % 16) + d % 2


def _packed_value_index(slot, d, D):
    """amx_packed V: (32-key slab, d tile, key pair, d, key of the pair), flattened."""
    return ((slot // 32 * (D // 16) + d // 16) * 16 + slot % 32 // 2) * 32 + 2 * (d % 16) + slot % 2


def _packed_rows(cache, pages, slots, index):
    """Rows (page, slot) of an amx_packed cache: `[n, Hkv, D]`, element d of each at
    index(slot, d, D) of its head's flattened slice."""
    P, hkv, ps, D = cache.shape
    at = index(np.asarray(slots)[:, None], np.arange(D)[None, :], D)  # [n, D]
    flat = cache.reshape(P, hkv, ps * D)[np.asarray(pages)]  # [n, Hkv, ps * D]
    return np.take_along_axis(flat, np.broadcast_to(at[:, None, :], (len(at), hkv, D)), axis=2)


def _requests(fmt, kw, defect):
    """Per request: (its pages, its context)."""
    ps = kw["page_size"]
    if fmt["page_table"] == "padded":
        lens = kw["seq_lens"]
        return [(kw["block_table"][b, :-(-int(c) // ps)], int(c)) for b, c in enumerate(lens)]
    ptr, idx, last = kw["kv_indptr"], kw["kv_indices"], kw["kv_last_page_len"]
    out = []
    for b in range(len(ptr) - 1):
        n = int(ptr[b + 1] - ptr[b])
        tail = int(last[b]) + (1 if defect == "csr_last_as_index" else 0)
        out.append((idx[ptr[b]:ptr[b + 1]], (n - 1) * ps + tail if n else 0))
    return out


def _queries(fmt, kw, b, ctx, defect):
    """Request b's query rows `[n, Hq, D]` and their positions."""
    if fmt["query_packing"] == "padded":
        q = kw["query"][b].swapaxes(0, 1)
    else:
        cu = kw["cu_seqlens_q"]
        q = kw["query"][cu[b]:cu[b + 1]]
    first = 0 if defect == "varlen_rows_from_start" else ctx - len(q)
    return q.astype(np.float64), np.arange(first, first + len(q))


def _window(fmt, kw, defect):
    conv = fmt["window_convention"]
    if conv == "count":
        return kw["window"]
    left = kw["window_size"][0] if conv == "flash" else kw["window_left"]
    if left < 0:
        return None
    return left if defect == "flash_left_as_count" else left + 1


def _bias(fmt, slope, j, p, ctx):
    """The ALiBi bias of the declared convention, from its definition."""
    conv = fmt.get("alibi_convention", "position")
    if conv == "context_end":
        return slope * (j - ctx + 1)
    if conv == "abs_distance":
        return -slope * np.abs(p - j)
    return slope * (j - p)  # position, bias_before_cap


def _lse_written(fmt, lse):
    """A natural-log lse as a kernel of the declared convention writes it."""
    return lse / np.log(2.0) if fmt.get("lse_convention", "natural") == "base2" else lse


def _empty_lse(fmt):
    return np.inf if fmt.get("empty_lse", "-inf") == "+inf" else -np.inf


def _attend(fmt, q, positions, k, v, kw, defect=None):
    """float64 attention of rows q `[n, Hq, Dk]` at `positions` over keys `[ctx, Hkv, Dk]`
    and values `[ctx, Hkv, Dv]`: (out `[n, Hq, Dv]`, lse `[n, Hq]` as the kernel writes it)."""
    n, hq, _ = q.shape
    group = hq // k.shape[1]
    keys = np.arange(len(k))
    window, causal, scale = _window(fmt, kw, defect), kw["causal"], kw["scale"]
    cap = kw.get("softcap")
    slopes = None if kw.get("alibi_slopes") is None else np.asarray(kw["alibi_slopes"], dtype=np.float64)
    sinks = None if kw.get("sinks") is None else np.asarray(kw["sinks"], dtype=np.float64)
    before_cap = fmt.get("alibi_convention") == "bias_before_cap"
    out, lse = np.zeros((n, hq, v.shape[-1])), np.zeros((n, hq))
    for i, p in enumerate(positions):
        seen = (keys <= p) & (keys > p - window if window else True) if causal else np.ones(len(k), bool)
        for h in range(hq):
            s = k[seen, h // group] @ q[i, h] * scale
            bias = 0.0 if slopes is None else _bias(fmt, slopes[h], keys[seen], p, len(k))
            if before_cap:
                s = s + bias
            if cap is not None:
                s = cap * np.tanh(s / cap)
            if not before_cap:
                s = s + bias
            m = s.max() if sinks is None else max(s.max(), sinks[h])
            w = np.exp(s - m)
            d = w.sum() + (0.0 if sinks is None else np.exp(sinks[h] - m))
            out[i, h] = w @ v[seen, h // group] / d
            lse[i, h] = _lse_written(fmt, m + np.log(d))
    return out, lse


def native_reference(defect: str | None = None, **fmt):
    """A float64 kernel in the native format `fmt` (layout, page_table, query_packing,
    window_convention), optionally with one `defect`."""
    fmt = {"layout": "hnd", "page_table": "padded", "query_packing": "padded", "window_convention": "count", **fmt}

    def kernel(**kw):
        kw = {**kw, "raw_dtype": next(kw[k].dtype for k in ("key_cache", "kv_cache") if k in kw)}
        outs, lses = [], []
        hq = kw["query"].shape[1]  # [B, Hq, L, Dk] or [T, Hq, Dk]
        for b, (pages, ctx) in enumerate(_requests(fmt, kw, defect)):
            pos = np.arange(ctx)
            k, v = _rows(fmt["layout"], kw, np.asarray(pages, dtype=np.int64)[pos // kw["page_size"]],
                         pos % kw["page_size"])
            q, positions = _queries(fmt, kw, b, ctx, defect)
            if ctx:
                o, lse = _attend(fmt, q, positions, k, v, kw, defect)
            else:  # an empty slot: zeros, and the empty lse of the convention
                o, lse = np.zeros((len(q), hq, v.shape[-1])), np.full((len(q), hq), _empty_lse(fmt))
            outs.append(o)
            lses.append(lse)
        dv = _rows(fmt["layout"], kw, np.zeros(0, np.int64), np.zeros(0, np.int64))[1].shape[-1]
        if fmt["query_packing"] == "varlen":
            out = np.concatenate(outs) if outs else np.zeros((0, hq, dv))
            lse = np.concatenate(lses) if lses else np.zeros((0, hq))
        else:
            B, _, L, _ = kw["query"].shape
            out = np.stack([o.swapaxes(0, 1) for o in outs]) if outs else np.zeros((B, hq, L, dv))
            lse = np.stack([x.swapaxes(0, 1) for x in lses]) if lses else np.zeros((B, hq, L))
        return (out, lse) if kw.get("return_lse") else out

    return kernel


FORMAT_AND_CONVENTION_KEYS = ("layout", "page_table", "query_packing", "window_convention", "lse_convention",
                              "empty_lse", "alibi_convention")
V2 = dict(softcap=True, alibi=True, sinks=True, lse=True, value_head_dim=True)


def _impl(defect=None, breaks=None, **fmt_and_caps):
    fmt = {k: fmt_and_caps.pop(k) for k in FORMAT_AND_CONVENTION_KEYS if k in fmt_and_caps}
    fn = from_numpy(native_reference(defect, **fmt), validates_input=False, **fmt, **fmt_and_caps)
    if breaks:
        fn.breaks = breaks
    return fn


nhd_csr_varlen_flash = _impl(layout="nhd", page_table="csr", query_packing="varlen", window_convention="flash")
kv_hnd_flashinfer = _impl(layout="kv_hnd", window_convention="flashinfer")
kv_nhd_csr = _impl(layout="kv_nhd", page_table="csr")
kv_last_varlen = _impl(layout="kv_last", query_packing="varlen")
vllm_split_varlen_f16 = _impl(layout="vllm_split", query_packing="varlen", dtypes=["float16", "bfloat16"])
CORRECT = ("nhd_csr_varlen_flash", "kv_hnd_flashinfer", "kv_nhd_csr", "kv_last_varlen", "vllm_split_varlen_f16")
# contract v2 in native formats and the conventions of the systems they resemble
v2_nhd_varlen = _impl(layout="nhd", query_packing="varlen", **V2)
v2_flashinfer_like = _impl(page_table="csr", window_convention="flashinfer", lse_convention="base2",
                           alibi_convention="bias_before_cap", **V2)
v2_fa2_like = _impl(layout="nhd", window_convention="flash", empty_lse="+inf", alibi_convention="abs_distance", **V2)
v2_vllm_like = _impl(layout="vllm_split", query_packing="varlen", alibi_convention="context_end",
                     dtypes=["float16", "bfloat16"], **V2)
CORRECT_V2 = ("v2_nhd_varlen", "v2_flashinfer_like", "v2_fa2_like", "v2_vllm_like")

flash_left_as_count = _impl("flash_left_as_count", "window", layout="nhd", window_convention="flash")
csr_last_as_index = _impl("csr_last_as_index", "oracle", page_table="csr")
varlen_rows_from_start = _impl("varlen_rows_from_start", "causal", query_packing="varlen")
BROKEN = {name: globals()[name].breaks for name in ("flash_left_as_count", "csr_last_as_index",
                                                     "varlen_rows_from_start")}

# quantized KV in each layout: the per-token scales in the layout's slot order (kv.py)
KV_ALL = dict(kv_dtypes=["float8_e4m3fn", "float8_e5m2", "int8"], kv_scales=["tensor", "head", "token"])
quant_hnd = _impl(page_table="csr", **KV_ALL)
quant_nhd = _impl(layout="nhd", query_packing="varlen", window_convention="flash", **KV_ALL)
quant_kv_hnd = _impl(layout="kv_hnd", page_table="csr", window_convention="flashinfer", **KV_ALL)
quant_kv_nhd = _impl(layout="kv_nhd", **KV_ALL)
quant_kv_last = _impl(layout="kv_last", query_packing="varlen", **KV_ALL)
quant_vllm_split = _impl(layout="vllm_split", **KV_ALL)
KV_LAYOUTS = {layout: f"quant_{layout}" for layout in ("hnd", "nhd", "kv_hnd", "kv_nhd", "kv_last", "vllm_split")}
