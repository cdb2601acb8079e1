"""compute-sanitizer's case (gpu/h200.sh): small calls on exactly sized pools, each checked."""

from __future__ import annotations

from gpu.h200.backend import import_paged, import_torch
from gpu.h200.reference import compare, gather, reference


def memcheck_case() -> int:
    """Small decode and prefill calls on exactly sized pools (no slack page: a read past the pool leaves
    the allocation), padded table entries far outside the pool (never to be read), NaN in the unused tail
    slots, ragged and empty contexts, both tile paths (page 16: a tile crosses pages; page 128: inside one),
    the score options; each output checked against the float32 reference. Exit 1 on a wrong result."""
    torch, cuda = import_torch(dry_run=False)
    paged = import_paged([])
    dev = "cuda" if cuda else "cpu"
    g = torch.Generator(device="cpu").manual_seed(1)
    Hq, Hkv, D, Dv = 8, 2, 64, 32
    failures = 0
    cases = [  # (name, L, page_size, ctx per request, options)
        ("decode ps16", 1, 16, [37, 0, 150], {}),
        ("decode L4 ps128 options", 4, 128, [200, 4, 129],
         dict(window=50, softcap=20.0, alibi=True, sinks=True, return_lse=True)),
        ("prefill ps128", 100, 128, [100, 230], {}),
        ("prefill ps16 options", 70, 16, [70, 133], dict(window=33, softcap=15.0, alibi=True, sinks=True,
                                                         return_lse=True)),
    ]
    for name, L, ps, lens, opt in cases:
        for dt in (torch.bfloat16, torch.float16):
            B = len(lens)
            n_pages = [-(-n // ps) for n in lens]
            P = sum(n_pages)
            width = max(n_pages) + 2
            table = torch.full((B, width), 1 << 30, dtype=torch.int32)  # unread entries: far outside the pool
            perm = torch.randperm(P, generator=g)
            at = 0
            for b, n in enumerate(n_pages):
                table[b, :n] = perm[at:at + n].to(torch.int32)
                at += n
            kp = torch.randn(P, Hkv, ps, D, generator=g).to(dt)
            vp = torch.randn(P, Hkv, ps, Dv, generator=g).to(dt)
            for b, n in enumerate(lens):  # NaN in each request's unused tail slots
                if n % ps:
                    last = int(table[b, n_pages[b] - 1])
                    kp[last, :, n % ps:] = float("nan")
                    vp[last, :, n % ps:] = float("nan")
            q = torch.randn(B, Hq, L, D, generator=g).to(dt)
            ctx = torch.tensor(lens, dtype=torch.int32)
            slopes = torch.linspace(-0.3, 0.3, Hq) if opt.get("alibi") else None
            sinks = torch.linspace(-1.0, 2.0, Hq) if opt.get("sinks") else None
            q, kp, vp, table, ctx = (x.to(dev) for x in (q, kp, vp, table, ctx))
            slopes = None if slopes is None else slopes.to(dev)
            sinks = None if sinks is None else sinks.to(dev)
            scale = D ** -0.5
            kw = dict(scale=scale, mask="causal", window=opt.get("window"), softcap=opt.get("softcap"),
                      alibi_slopes=slopes, sinks=sinks, return_lse=opt.get("return_lse", False))
            res = paged.attention(q, kp, vp, table, ctx, ps, **kw)
            out, lse = res if kw["return_lse"] else (res, None)
            if cuda:
                torch.cuda.synchronize()
            worst = 0.0
            ok = True
            for b, n in enumerate(lens):
                kd = gather(kp, table[b:b + 1, :n_pages[b]], n)[0]
                vd = gather(vp, table[b:b + 1, :n_pages[b]], n)[0]
                ref, ref_lse = reference(torch, q[b], kd, vd, n, scale=scale, window=kw["window"],
                                         softcap=kw["softcap"], slopes=slopes, sinks=sinks)
                if n == 0:
                    ref_lse = torch.full_like(ref_lse, float("-inf"))
                c = compare(torch, out[b], ref, dt)
                worst = max(worst, c["max_rel_row"])
                ok &= c["ok"]
                if lse is not None:
                    same_inf = bool((torch.isinf(lse[b]) == torch.isinf(ref_lse)).all())
                    fin = torch.isfinite(ref_lse)
                    lse_err = float((lse[b][fin] - ref_lse[fin]).abs().max()) if fin.any() else 0.0
                    ok &= same_inf and lse_err <= 1e-3 * max(1.0, float(ref_lse[fin].abs().max()) if fin.any()
                                                             else 1.0)
            failures += not ok
            print(f"memcheck case {name} {str(dt).removeprefix('torch.')}: worst row-relative error {worst:.2e} "
                  f"{'ok' if ok else 'WRONG'}", flush=True)
    print(f"memcheck case: {'all ok' if not failures else f'{failures} wrong'} on {dev}", flush=True)
    return 1 if failures else 0
