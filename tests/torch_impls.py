"""torch kernels for tests/test_bridges.py (`--impl tests.torch_impls:NAME`; needs torch).

| name                | what it is                                                            |
|---------------------|-----------------------------------------------------------------------|
| `nhd_varlen_flash`  | tests/format_impls.py's float64 native reference behind `from_torch`: torch tensors in the NHD / varlen / flash format, computed on host copies, a tensor of the query's dtype back (the bridge casts nothing unless `widens_to` is declared) |
| `nhd_varlen_flash_v2` | the same, declaring all of contract v2 (its float64 reference computes it) |
| `v2_reference`      | a float64 torch kernel in the contract's own signature computing all of contract v2 (soft-cap, ALiBi, sinks, `return_lse`, Dv != Dk) with torch ops: the output in the query's dtype, the lse float32 |
| `v2_sinks_ignored`  | the same, declaring sinks but dropping the sink from the softmax (vLLM #52148's class) |
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


def reference_v2(query, key_pages, value_pages, block_table, context_lens, page_size, *, scale=None,
                 mask="causal", window=None, softcap=None, alibi_slopes=None, sinks=None, return_lse=False,
                 drop_sinks=False):
    """REFERENCE.md 1b in float64 torch, one request at a time (torch tensors in and out)."""
    B, Hq, L, Dk = query.shape
    Hkv, Dv = key_pages.shape[1], value_pages.shape[-1]
    group = Hq // Hkv
    scale = Dk ** -0.5 if scale is None else float(scale)
    q, kp, vp = query.double(), key_pages.double(), value_pages.double()
    out = torch.zeros(B, Hq, L, Dv, dtype=torch.float64)
    lse = torch.full((B, Hq, L), -torch.inf, dtype=torch.float64)
    for b in range(B):
        ctx = int(context_lens[b])
        if ctx == 0:  # an empty slot: zeros, lse -inf
            continue
        j = torch.arange(ctx)
        pages = block_table[b, j // page_size].long()
        k = kp[pages, :, j % page_size].repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, ctx, Dk]
        v = vp[pages, :, j % page_size].repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, ctx, Dv]
        s = q[b] @ k.transpose(1, 2) * scale  # [Hq, L, ctx]
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        p = torch.arange(ctx - L, ctx)[:, None]
        if alibi_slopes is not None:
            s = s + alibi_slopes.double()[:, None, None] * (j[None, :] - p)
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
        out[b] = (w @ v) / d
        lse[b] = (m + torch.log(d))[..., 0]
    out = out.to(query.dtype)
    return (out, lse.float()) if return_lse else out


def _v2_sinks_ignored(*args, **kwargs):
    return reference_v2(*args, drop_sinks=True, **kwargs)


v2_reference = from_torch(reference_v2, device="cpu", validates_input=False, **V2)
v2_sinks_ignored = from_torch(_v2_sinks_ignored, device="cpu", validates_input=False, **V2)
