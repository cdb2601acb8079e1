"""The cases and their float32 reference: pools in a shuffled page order, K/V gathered to dense,
attention in float32 torch, and the error rule (TOL_EPS eps of the dtype, per output row)."""

from __future__ import annotations

from gpu.h200.rows import Row

TOL_EPS = 8  # allowed error: TOL_EPS * eps(dtype), relative to each output row's largest |value|


def make_case(torch, row: Row, dev: str, seed: int = 0):
    """The pools (pages in a shuffled physical order), the table, the query, and K/V gathered to dense."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    dt = getattr(torch, row.dtype)
    ps, n_pages = row.page_size, -(-row.S // row.page_size)
    P = row.B * n_pages
    table = torch.randperm(P, generator=g).view(row.B, n_pages).to(torch.int32).to(dev)
    kp = torch.randn(P, row.Hkv, ps, row.D, device=dev, dtype=torch.float32).to(dt)
    vp = torch.randn(P, row.Hkv, ps, row.D, device=dev, dtype=torch.float32).to(dt)
    q = torch.randn(row.B, row.Hq, row.L, row.D, device=dev, dtype=torch.float32).to(dt)
    ctx = torch.full((row.B,), row.S, dtype=torch.int32, device=dev)
    return q, kp, vp, table, ctx


def gather(pages, table, S: int):
    """[B, Hkv, S, D] of the pool's pages in each request's logical order."""
    B, n = table.shape
    _, H, ps, D = pages.shape
    return pages[table.long()].permute(0, 2, 1, 3, 4).reshape(B, H, n * ps, D)[:, :, :S].contiguous()


def reference(torch, q, k, v, ctx_len: int, *, scale, causal=True, window=None, softcap=None, slopes=None,
              sinks=None):
    """Float32 attention of one request: q [Hq, L, D], k/v [Hkv, >= ctx, D]; returns (out [Hq, L, Dv], lse)."""
    Hq, L, D = q.shape
    Hkv, Dv = k.shape[0], v.shape[-1]
    G = Hq // Hkv
    q, k, v = q.float().view(Hkv, G, L, D), k[:, :ctx_len].float(), v[:, :ctx_len].float()
    out = torch.zeros(Hkv, G, L, Dv, dtype=torch.float32, device=q.device)
    lse = torch.full((Hkv, G, L), float("-inf"), dtype=torch.float32, device=q.device)
    if ctx_len == 0:
        return out.view(Hq, L, Dv), lse.view(Hq, L)
    j = torch.arange(ctx_len, device=q.device)
    chunk = max(1, (1 << 27) // max(1, Hq * ctx_len))
    for r0 in range(0, L, chunk):
        rows = torch.arange(r0, min(L, r0 + chunk), device=q.device)
        pos = ctx_len - L + rows
        s = torch.einsum("kgld,knd->kgln", q[:, :, r0:r0 + len(rows)], k) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        if slopes is not None:
            s = s + slopes.float().view(Hkv, G, 1, 1) * (j[None, :] - pos[:, None]).float()
        vis = torch.ones(len(rows), ctx_len, dtype=torch.bool, device=q.device)
        if causal:
            vis &= j[None, :] <= pos[:, None]
            if window is not None:
                vis &= j[None, :] > pos[:, None] - window
        s = s.masked_fill(~vis, float("-inf"))
        m = s.amax(-1)
        if sinks is not None:
            m = torch.maximum(m, sinks.float().view(Hkv, G, 1))
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        p = torch.exp(s - m[..., None])
        d = p.sum(-1)
        if sinks is not None:
            d = d + torch.exp(sinks.float().view(Hkv, G, 1) - m)
        o = torch.einsum("kgln,knd->kgld", p, v)
        out[:, :, r0:r0 + len(rows)] = torch.where(d[..., None] > 0, o / d.clamp_min(1e-38)[..., None], 0.0)
        lse[:, :, r0:r0 + len(rows)] = torch.where(d > 0, m + torch.log(d.clamp_min(1e-38)), float("-inf"))
    return out.view(Hq, L, Dv), lse.view(Hq, L)


def compare(torch, out, ref, dtype) -> dict:
    """Max abs error, and the max error relative to each output row's largest |value|."""
    diff = (out.float() - ref).abs()
    if diff.numel() == 0:
        return {"max_abs": 0.0, "max_rel_row": 0.0, "tol_rel_row": 0.0, "ok": True}
    scale = ref.abs().amax(-1, keepdim=True).clamp_min(1e-6)
    rel = float((diff / scale).max())
    tol = TOL_EPS * torch.finfo(dtype).eps
    finite = bool(torch.isfinite(out.float()).all())
    return {"max_abs": float(diff.max()), "max_ref": float(ref.abs().max()), "max_rel_row": rel,
            "tol_rel_row": tol, "ok": finite and rel <= tol}


def reference_batch(torch, row: Row, q, kd, vd, scale):
    return torch.stack([reference(torch, q[b], kd[b], vd[b], row.S, scale=scale)[0] for b in range(row.B)])
