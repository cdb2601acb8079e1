"""torch kernels for tests/test_bridges.py (`--impl tests.torch_impls:NAME`; needs torch).

| name                | what it is                                                            |
|---------------------|-----------------------------------------------------------------------|
| `nhd_varlen_flash`  | tests/format_impls.py's float64 native reference behind `from_torch`: torch tensors in the NHD / varlen / flash format, computed on host copies, a tensor of the query's dtype back (the bridge casts nothing unless `widens_to` is declared) |
| `nhd_varlen_flash_v2` | the same, declaring all of contract v2 (its float64 reference computes it) |
| `v2_reference`      | a float64 torch kernel in the contract's own signature computing all of contract v2 (soft-cap, ALiBi, sinks, `return_lse`, Dv != Dk) with torch ops: the output in the query's dtype, the lse float32 |
| `v2_sinks_ignored`  | the same, declaring sinks but dropping the sink from the softmax (vLLM #52148's class) |
| `kv_reference`      | `reference_v2` declaring every KV format and scale granularity too: it decodes the pages with torch's own fp8 dtypes and asserts it was handed them (`torch.float8_e4m3fn`, `torch.float8_e5m2`, `torch.int8`; scales float32 tensors) |
| `kv_e4m3_tensor_only` | the same kernel declaring only float8_e4m3fn with per-tensor scales (the rest skipped with reasons) |
| `kv_nhd_varlen_flash` | the native NHD / varlen / flash kernel above declaring every KV format and granularity: torch decodes its fp8 caches (`.float()`), its per-token scales come `[P, ps, Hkv]` |

Kernels that misread quantized pages the way real ones do (KV_BROKEN: each fails at clause `kv_format`):

| name                          | the defect                                                          |
|-------------------------------|---------------------------------------------------------------------|
| `kv_v_scale_twice`            | V's scale applied twice (once to the weights, once to the output)   |
| `kv_e5m2_as_e4m3`             | float8_e5m2 pages decoded as float8_e4m3fn (the view of the wrong format) |
| `kv_head_scale_by_query_head` | per-head scales indexed by the query head (`h % Hkv`) instead of its KV head `h // G` |
| `kv_token_scale_logical`      | per-token scales read at the logical slot `[j // ps, g, j % ps]` instead of the physical one |
"""

from __future__ import annotations

import torch

from conformance.bridges import from_torch
from tests.format_impls import V2, native_reference

FORMAT = dict(layout="nhd", query_packing="varlen", window_convention="flash")
_reference = native_reference(**FORMAT)


def _host(x):
    return x.float().numpy() if isinstance(x, torch.Tensor) and x.is_floating_point() else (
        x.numpy() if isinstance(x, torch.Tensor) else x)


def _nhd_varlen_flash(**kw):
    out = _reference(**{k: _host(v) for k, v in kw.items()})
    if isinstance(out, tuple):
        return torch.from_numpy(out[0]).to(kw["query"].dtype), torch.from_numpy(out[1]).float()
    return torch.from_numpy(out).to(kw["query"].dtype)


nhd_varlen_flash = from_torch(_nhd_varlen_flash, device="cpu", validates_input=False, **FORMAT)
nhd_varlen_flash_v2 = from_torch(_nhd_varlen_flash, device="cpu", validates_input=False, **FORMAT, **V2)


# the torch dtype a kernel must be handed for each format (conformance/bridges.py)
KV_TORCH = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2, "int8": torch.int8}
KV_ALL = dict(kv_dtypes=list(KV_TORCH), kv_scales=["tensor", "head", "token"])


def _codes(pages, kv_dtype, defect):
    """The pool's values before scaling, float64: the pages themselves, or their codes
    decoded by torch's own dtype, which must be the format's."""
    if kv_dtype is None:
        return pages.double()
    assert pages.dtype == KV_TORCH[kv_dtype], f"{kv_dtype} pages handed as {pages.dtype}, not {KV_TORCH[kv_dtype]}"
    if defect == "e5m2_as_e4m3" and kv_dtype == "float8_e5m2":
        pages = pages.view(torch.float8_e4m3fn)
    return pages.double()


def _row_scales(s, pages, j, page_size, Hq, Hkv, defect):
    """The scale of each (key j, query head h) of one request, float64 `[ctx, Hq]`:
    per tensor, per KV head `h // G`, or per (physical slot, KV head)."""
    group = Hq // Hkv
    if s is None:
        return torch.ones(len(j), Hq, dtype=torch.float64)
    assert isinstance(s, torch.Tensor) and s.dtype == torch.float32, f"a scale handed as {type(s)} {s.dtype}"
    s = s.double()
    kv_head = torch.arange(Hq) // group
    if defect == "head_scale_by_query_head":
        kv_head = torch.arange(Hq) % Hkv  # the query head's index, wrapped into [0, Hkv)
    if s.ndim == 0:
        return s.expand(len(j), Hq)
    if s.ndim == 1:
        return s[kv_head].expand(len(j), Hq)
    slots = s[j // page_size, :] if defect == "token_scale_logical" else s[pages, :]  # [ctx, Hkv, ps]
    return slots[torch.arange(len(j)), :, j % page_size][:, kv_head]


def reference_v2(query, key_pages, value_pages, block_table, context_lens, page_size, *, scale=None,
                 mask="causal", window=None, softcap=None, alibi_slopes=None, sinks=None, return_lse=False,
                 kv_dtype=None, k_scale=None, v_scale=None, drop_sinks=False, defect=None):
    """REFERENCE.md 1b in float64 torch, one request at a time (torch tensors in and out);
    quantized pages decoded by torch (`x = decode(code) * s`)."""
    B, Hq, L, Dk = query.shape
    Hkv, Dv = key_pages.shape[1], value_pages.shape[-1]
    group = Hq // Hkv
    scale = Dk ** -0.5 if scale is None else float(scale)
    q, kp, vp = query.double(), _codes(key_pages, kv_dtype, defect), _codes(value_pages, kv_dtype, defect)
    out = torch.zeros(B, Hq, L, Dv, dtype=torch.float64)
    lse = torch.full((B, Hq, L), -torch.inf, dtype=torch.float64)
    for b in range(B):
        ctx = int(context_lens[b])
        if ctx == 0:  # an empty slot: zeros, lse -inf
            continue
        j = torch.arange(ctx)
        pages = block_table[b, j // page_size].long()
        ks = _row_scales(k_scale, pages, j, page_size, Hq, Hkv, defect)  # [ctx, Hq]
        vs = _row_scales(v_scale, pages, j, page_size, Hq, Hkv, defect)
        if defect == "v_scale_twice":
            vs = vs * vs
        k = (kp[pages, :, j % page_size].repeat_interleave(group, dim=1) * ks[..., None]).transpose(0, 1)
        v = (vp[pages, :, j % page_size].repeat_interleave(group, dim=1) * vs[..., None]).transpose(0, 1)
        s = q[b] @ k.transpose(1, 2) * scale  # [Hq, L, ctx]
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        p = torch.arange(ctx - L, ctx)[:, None]
        if alibi_slopes is not None:
            s = s + alibi_slopes.double()[:, None, None] * (j[None, :] - p)
        seen = torch.ones(L, ctx, dtype=torch.bool)
        if mask is not None:
            seen = j[None, :] <= p
            if window is not None:
                seen = seen & (j[None, :] > p - window)
            s = s.masked_fill(~seen, -torch.inf)
        m = s.amax(dim=-1, keepdim=True)
        sigma = None if sinks is None or drop_sinks else sinks.double()[:, None, None]
        if sigma is not None:
            m = torch.maximum(m, sigma)
        w = torch.exp(s - m)
        d = w.sum(dim=-1, keepdim=True) + (0.0 if sigma is None else torch.exp(sigma - m))
        # a key a row does not see adds nothing, whatever its value (a NaN or inf code included)
        out[b] = torch.where(seen[None, :, :, None], w[..., None] * v[:, None], 0.0).sum(dim=2) / d
        lse[b] = (m + torch.log(d))[..., 0]
    out = out.to(query.dtype)
    return (out, lse.float()) if return_lse else out


def _v2_sinks_ignored(*args, **kwargs):
    return reference_v2(*args, drop_sinks=True, **kwargs)


v2_reference = from_torch(reference_v2, device="cpu", validates_input=False, **V2)
v2_sinks_ignored = from_torch(_v2_sinks_ignored, device="cpu", validates_input=False, **V2)


# quantized KV (contract/kv_format.py): the reference declaring it, and misreadings of it
kv_reference = from_torch(reference_v2, device="cpu", validates_input=False, **V2, **KV_ALL)
kv_e4m3_tensor_only = from_torch(reference_v2, device="cpu", validates_input=False, kv_dtypes=["float8_e4m3fn"])


def _native_kv(**kw):
    """The native NHD / varlen / flash reference on torch's own decode of the caches:
    fp8 codes as float (torch's decode), int8 codes as they are (their value)."""
    dtypes = {k: v.dtype for k, v in kw.items() if k in ("key_cache", "value_cache")}
    assert all(d == KV_TORCH.get(kw.get("kv_dtype"), kw["query"].dtype) for d in dtypes.values()), dtypes
    return _nhd_varlen_flash(**kw)


kv_nhd_varlen_flash = from_torch(_native_kv, device="cpu", validates_input=False, **FORMAT, **KV_ALL)


def _misreading(defect: str):
    def kernel(*args, **kwargs):
        return reference_v2(*args, defect=defect, **kwargs)

    fn = from_torch(kernel, device="cpu", validates_input=False, **KV_ALL)
    fn.breaks = "kv_format"
    return fn


kv_v_scale_twice = _misreading("v_scale_twice")
kv_e5m2_as_e4m3 = _misreading("e5m2_as_e4m3")
kv_head_scale_by_query_head = _misreading("head_scale_by_query_head")
kv_token_scale_logical = _misreading("token_scale_logical")
KV_BROKEN = {name: globals()[name].breaks for name in ("kv_v_scale_twice", "kv_e5m2_as_e4m3",
                                                       "kv_head_scale_by_query_head", "kv_token_scale_logical")}
