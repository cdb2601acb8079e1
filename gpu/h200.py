"""One prepared measurement run of the Triton paged attention on a GPU (made for an H200).

    python -m gpu.h200 --out DIR [--budget-s 420] [--only REGEX] [--no-flex]
    python -m gpu.h200 --out DIR --dry-run       # the same code path on the CPU (TRITON_INTERPRET=1), tiny shapes
    python -m gpu.h200 --memcheck-case           # a few small calls, for compute-sanitizer to wrap (gpu/h200.sh)

Writes DIR/h200.json and DIR/h200.md:

| section     | what |
|-------------|------|
| `device`    | name, SM count, memory, torch / triton / CUDA versions |
| `bandwidth` | a large device-to-device copy timed in this run: GB/s of bytes read + written (the denominator of every bandwidth fraction) and of bytes read |
| `rows`      | one per shape (Qwen3-4B: Hq 32, Hkv 8, D 128): decode L=1 at B 1/16, S 1K/8K/32K, page size 16/128, bf16/f16; prefill L=S 1K/8K at B=1 |
| `skipped`   | rows left out, with the reason (the budget, --only) |
| `goal`      | decode at S >= 8192 reads at least 80% of the measured copy bandwidth, row by row |

Each row times, with CUDA events around each call after an L2 flush, the median of many:
`ours` (gpu.paged.attention, the whole call: its checks' host read included), `ours_kernels`
(the call's kernel launches, `gpu.paged.plan`, replayed from a CUDA graph: the device time),
`sdpa` (torch SDPA, `enable_gqa`, on the K/V gathered to dense beforehand, untimed),
`sdpa_graph` (the same from a CUDA graph) and `flex` (FlexAttention + torch's PagedAttention
on the pool laid out heads-first beforehand, `torch.compile`d; "absent" when torch lacks it).
`ratio` is baseline time / ours (> 1: ours faster), eager against eager (`ratio`) and graph
against graph (`ratio_graph`). Bytes of a row: K and V of the context (B * S * Hkv * D * 2 *
itemsize) plus query and output; the bandwidth fraction is bytes / time / copy bandwidth.
Before any timing each path's output is checked against a float32 reference on the gathered
K/V (`error`): max abs error, and the error relative to each output row's largest value
against 8 * eps(dtype); a row whose kernel is wrong is reported WRONG, never as fast.

The budget (--budget-s, seconds since start): each row's time is estimated from the last row of
its kind (its time, plus its slowest call scaled by the work) and a row that would end past the
budget is skipped and listed. --dry-run: the CPU, the Triton interpreter, tiny shapes (Hq 4,
Hkv 2, D 16, S 64), time.perf_counter, eager FlexAttention, no CUDA graphs, no goal.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

T0 = time.monotonic()
GOAL_FRACTION = 0.8
GOAL_MIN_S = 8192
GOAL_TEXT = f"decode (L=1) at S >= {GOAL_MIN_S}: at least {GOAL_FRACTION:.0%} of the measured HBM copy bandwidth"
TOL_EPS = 8  # allowed error: TOL_EPS * eps(dtype), relative to each output row's largest |value|


@dataclass(frozen=True)
class Row:
    kind: str  # "decode" (L=1) or "prefill" (L=S)
    B: int
    S: int
    page_size: int
    dtype: str
    Hq: int = 32
    Hkv: int = 8
    D: int = 128

    @property
    def L(self) -> int:
        return 1 if self.kind == "decode" else self.S

    @property
    def name(self) -> str:
        return f"{self.kind} B{self.B} S{self.S} ps{self.page_size} {self.dtype}"

    def bytes(self) -> int:
        item = 4 if self.dtype == "float32" else 2
        kv = self.B * self.S * self.Hkv * self.D * 2 * item
        return kv + 2 * self.B * self.Hq * self.L * self.D * item

    def flops(self) -> float:
        """QK^T and PV over the causally visible pairs."""
        pairs = self.S if self.L == 1 else self.L * (self.L + 1) // 2 + self.L * (self.S - self.L)
        return 4.0 * self.B * self.Hq * self.D * pairs

    def work(self) -> float:
        return float(self.bytes()) if self.kind == "decode" else self.flops()


def gpu_rows() -> list[Row]:
    """In order of importance (a short budget drops the tail): bf16 decode, bf16 prefill, then f16."""
    rows = []
    for dtype in ("bfloat16", "float16"):
        for S in (8192, 32768, 1024):
            for B in (16, 1):
                for ps in (16, 128):
                    rows.append(Row("decode", B, S, ps, dtype))
        for S in (1024, 8192):
            for ps in (128, 16):
                rows.append(Row("prefill", 1, S, ps, dtype))
    return rows


def dry_rows() -> list[Row]:
    tiny = dict(Hq=4, Hkv=2, D=16)
    return [Row("decode", 2, 64, 16, "bfloat16", **tiny), Row("decode", 1, 64, 32, "float16", **tiny),
            Row("prefill", 1, 64, 16, "bfloat16", **tiny),
            Row("prefill", 1, 4096, 16, "bfloat16", **tiny)]  # minutes in the interpreter: the budget skips it


# --- set-up: the environment before triton is imported ---------------------------------------------------

def parse(argv=None):
    p = argparse.ArgumentParser(prog="python -m gpu.h200", description=__doc__.splitlines()[0])
    p.add_argument("--out", metavar="DIR", help="where h200.json and h200.md go")
    p.add_argument("--dry-run", action="store_true", help="CPU, TRITON_INTERPRET=1, tiny shapes")
    p.add_argument("--budget-s", type=float, default=420.0, help="seconds since start past which no row starts")
    p.add_argument("--only", metavar="REGEX", help="only the rows whose name matches")
    p.add_argument("--no-flex", action="store_true", help="leave FlexAttention out")
    p.add_argument("--memcheck-case", action="store_true",
                   help="a few small decode and prefill calls, checked (for compute-sanitizer)")
    args = p.parse_args(argv)
    if not args.memcheck_case and not args.out:
        p.error("--out DIR is required")
    return args


def import_torch(dry_run: bool):
    if dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (gpu.paged sets it only without CUDA)
    import torch

    cuda = torch.cuda.is_available() and not dry_run
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return torch, cuda


def import_paged(notes: list):
    """gpu.paged (its conformance bridge, which needs MLX, is built only on first access)."""
    import gpu.paged as paged

    return paged


# --- timing ------------------------------------------------------------------------------------------------

class Clock:
    """Median per-call time: CUDA events around each call after an L2 flush, or perf_counter on the CPU."""

    def __init__(self, torch, cuda: bool):
        self.torch, self.cuda = torch, cuda
        self.flush_buf = torch.empty(256 << 20, dtype=torch.int8, device="cuda") if cuda else None
        self.rep_s = 0.12 if cuda else 0.05
        self.rounds = (10, 400) if cuda else (3, 8)

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def measure(self, fn) -> dict:
        torch = self.torch
        lo, hi = self.rounds
        if not self.cuda:
            t = time.perf_counter()
            fn()
            first = time.perf_counter() - t
            n = max(lo, min(hi, math.ceil(self.rep_s / max(first, 1e-9))))
            times = []
            for _ in range(n):
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            return _summary(times, "perf_counter")
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            fn()
        end.record()
        torch.cuda.synchronize()
        est = start.elapsed_time(end) / 3e3
        n = max(lo, min(hi, math.ceil(self.rep_s / max(est, 1e-6))))
        for _ in range(max(2, n // 5)):  # warm-up
            fn()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        for i in range(n):
            self.flush_buf.zero_()  # no K/V left in L2 from the last call
            starts[i].record()
            fn()
            ends[i].record()
        torch.cuda.synchronize()
        return _summary([s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends)], "cuda events, L2 flushed")

    def graph(self, fn):
        """fn captured into a CUDA graph: a callable replaying it (None on the CPU)."""
        if not self.cuda:
            return None
        torch = self.torch
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        torch.cuda.synchronize()
        return g.replay


def _summary(times, method) -> dict:
    times = sorted(times)
    return {"median_s": statistics.median(times), "min_s": times[0],
            "p90_s": times[min(len(times) - 1, int(0.9 * len(times)))], "rounds": len(times), "method": method}


# --- the measured run -------------------------------------------------------------------------------------

def device_facts(torch, cuda: bool, dry_run: bool) -> dict:
    import triton

    facts = {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
             "cuda_runtime": torch.version.cuda, "host": platform.node(), "cpu_count": os.cpu_count(),
             "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1"}
    if cuda:
        prop = torch.cuda.get_device_properties(0)
        facts.update(name=prop.name, sm_count=prop.multi_processor_count, memory_gib=round(prop.total_memory / 2**30, 1),
                     compute_capability=f"{prop.major}.{prop.minor}",
                     l2_cache_mib=round(getattr(prop, "L2_cache_size", 0) / 2**20, 1) or None)
        try:
            import subprocess

            q = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.max.memory,clocks.max.sm,power.limit",
                                "--format=csv,noheader"], capture_output=True, text=True, timeout=15)
            facts["nvidia_smi"] = q.stdout.strip() or q.stderr.strip()
        except Exception as e:  # noqa: BLE001 -- a fact, not a requirement
            facts["nvidia_smi"] = f"unavailable: {e}"
    else:
        facts.update(name=f"cpu {platform.processor() or platform.machine()}"
                          + (" (dry run: TRITON_INTERPRET=1)" if dry_run else " (no CUDA: TRITON_INTERPRET=1)"),
                     sm_count=None)
    return facts


def measure_bandwidth(torch, cuda: bool, clock: Clock) -> dict:
    """A device-to-device copy of a large buffer (4 GiB on a GPU, 64 MiB on the CPU)."""
    n = (4 << 30) if cuda else (64 << 20)
    dev = "cuda" if cuda else "cpu"
    src = torch.empty(n, dtype=torch.uint8, device=dev)
    src.fill_(1)
    dst = torch.empty_like(src)
    if cuda:  # the copy is far larger than L2: no flush needed, and none timed
        dst.copy_(src)
        torch.cuda.synchronize()
        times = []
        for _ in range(12):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src)
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        timing = _summary(times, "cuda events")
    else:
        timing = clock.measure(lambda: dst.copy_(src))
    t = timing["median_s"]
    out = {"bytes_copied": n, "median_s": t, "rounds": timing["rounds"], "method": timing["method"],
           "copy_gbps": 2 * n / t / 1e9, "read_gbps": n / t / 1e9,
           "note": "copy_gbps counts bytes read + written (the denominator of the bandwidth fractions); "
                   "read_gbps the bytes read alone"}
    return out  # the buffers go with this frame (run() empties torch's cache after)


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


class Flex:
    """FlexAttention + torch's PagedAttention on the pool (peers/flex_attention.py's use), compiled on a GPU."""

    def __init__(self, torch, compiled: bool):
        self.torch, self.compiled = torch, compiled
        try:
            from torch.nn.attention import flex_attention as fa
            from torch.nn.attention.experimental import _paged_attention as pa
        except ImportError as e:
            self.absent = f"absent ({e})"
            return
        self.absent = None
        self.fa, self.pa = fa, pa
        if compiled:
            import torch._dynamo as dynamo

            for knob in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                         "accumulated_cache_size_limit"):
                if hasattr(dynamo.config, knob):  # one compile per row: never fall back to eager silently
                    setattr(dynamo.config, knob, 4096)

    def prepare(self, row: Row, q, kp, vp, table, ctx, scale):
        torch, fa = self.torch, self.fa
        B, Hq, L, D = q.shape
        P, Hkv, ps, _ = kp.shape
        dev = q.device
        kc = kp.transpose(0, 1).reshape(1, Hkv, P * ps, D)  # heads first: a copy, made once, untimed
        vc = vp.transpose(0, 1).reshape(1, Hkv, P * ps, vp.shape[-1])
        kv_len = ctx.to(torch.int64)
        paged = self.pa.PagedAttention(P, ps, B, device=dev)
        n = -(-row.S // ps)
        for b in range(B):
            pages = table[b, :n].to(torch.int64)
            paged.page_table[b, :n] = pages
            paged.physical_to_logical[b, pages] = torch.arange(n, device=dev)

        def visible(b, h, q_idx, kv_idx):
            return kv_idx <= kv_len[b] - L + q_idx

        logical = fa.create_block_mask(visible, B, None, L, n * ps, device=dev, BLOCK_SIZE=(128, ps))
        physical = paged.convert_logical_block_mask(logical, kv_len=kv_len)
        if self.compiled:
            torch._dynamo.reset()  # each row compiles on its own: no guard pile-up across rows
            fn = torch.compile(fa.flex_attention, dynamic=False)
        else:
            fn = fa.flex_attention
        # prefill with small pages: the kernel's key block must divide the page (flex_decoding clamps it itself)
        opts = {"BLOCK_N": ps} if self.compiled and L > 1 and ps < 64 else None
        import warnings

        def call():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # eager flex warns it is not compiled
                return fn(q, kc, vc, block_mask=physical, scale=scale, enable_gqa=True, kernel_options=opts)

        return call, {"kernel_options": opts}


def sdpa_call(torch, q, kd, vd, scale, causal):
    F = torch.nn.functional
    try:
        F.scaled_dot_product_attention(q[:1, :, :1], kd[:1, :, :1], vd[:1, :, :1], scale=scale, enable_gqa=True)
        return (lambda: F.scaled_dot_product_attention(q, kd, vd, is_causal=causal, scale=scale, enable_gqa=True)), \
            "enable_gqa"
    except TypeError:  # an older torch: K/V repeated per query head (beforehand, untimed)
        G = q.shape[1] // kd.shape[1]
        kr, vr = kd.repeat_interleave(G, 1), vd.repeat_interleave(G, 1)
        return (lambda: F.scaled_dot_product_attention(q, kr, vr, is_causal=causal, scale=scale)), "repeat_interleave"


def run_row(torch, paged, row: Row, clock: Clock, flex: Flex | None, copy_gbps: float, cuda: bool) -> dict:
    t_row = time.monotonic()
    res = measure_row(torch, paged, row, clock, flex, copy_gbps, cuda)  # its tensors and graphs freed on return
    if cuda:
        torch.cuda.empty_cache()
    res["row_s"] = time.monotonic() - t_row
    res["slowest_call_s"] = max((p.get("median_s", 0.0) for p in res["paths"].values()), default=0.0)
    return res


def measure_row(torch, paged, row: Row, clock: Clock, flex: Flex | None, copy_gbps: float, cuda: bool) -> dict:
    dev = "cuda" if cuda else "cpu"
    res = {"name": row.name, **asdict(row), "L": row.L, "bytes": row.bytes(), "flops": row.flops(), "paths": {},
           "error": {}, "notes": []}
    scale = row.D ** -0.5
    q, kp, vp, table, ctx = make_case(torch, row, dev)
    kd, vd = gather(kp, table, row.S), gather(vp, table, row.S)
    ref = reference_batch(torch, row, q, kd, vd, scale)
    dt = q.dtype
    calls = {}

    def ours():
        return paged.attention(q, kp, vp, table, ctx, row.page_size, scale=scale, mask="causal")

    t = time.monotonic()
    out = ours()
    clock.sync()
    res["ours_first_call_s"] = time.monotonic() - t  # the Triton compile of this variant, the first time
    res["error"]["ours"] = compare(torch, out, ref, dt)
    calls["ours"] = ours
    out_k, _, launches = paged.plan(q, kp, vp, table, ctx, scale=scale, mask="causal")

    def kernels():
        for launch in launches:
            launch.run()

    try:
        replay = clock.graph(kernels)
        calls["ours_kernels"] = replay or kernels
        (replay or kernels)()
        clock.sync()
        res["error"]["ours_kernels"] = compare(torch, out_k, ref, dt)
    except Exception as e:  # noqa: BLE001
        res["paths"]["ours_kernels"] = {"status": f"error: {type(e).__name__}: {e}"}
    try:
        sdpa, how = sdpa_call(torch, q, kd, vd, scale, causal=row.L > 1)
        res["error"]["sdpa"] = compare(torch, sdpa(), ref, dt)
        res["notes"].append(f"sdpa: {how}")
        calls["sdpa"] = sdpa
        if cuda:
            try:
                calls["sdpa_graph"] = clock.graph(sdpa)
            except Exception as e:  # noqa: BLE001
                res["paths"]["sdpa_graph"] = {"status": f"error: {type(e).__name__}: {e}"}
    except Exception as e:  # noqa: BLE001
        res["paths"]["sdpa"] = {"status": f"error: {type(e).__name__}: {e}"}
    if flex is None:
        res["paths"]["flex"] = {"status": "left out (--no-flex)"}
    elif flex.absent:
        res["paths"]["flex"] = {"status": flex.absent}
    else:
        try:
            t = time.monotonic()
            call, info = flex.prepare(row, q, kp, vp, table, ctx, scale)
            fout = call()
            clock.sync()
            res["flex_first_call_s"] = time.monotonic() - t  # torch.compile of this shape included
            res["error"]["flex"] = compare(torch, fout, ref, dt)
            res["flex"] = {"compiled": flex.compiled, **info}
            calls["flex"] = call
            del fout
        except Exception as e:  # noqa: BLE001
            res["paths"]["flex"] = {"status": f"error: {type(e).__name__}: {str(e)[:400]}"}
    for name, fn in calls.items():
        try:
            res["paths"][name] = clock.measure(fn)
        except Exception as e:  # noqa: BLE001
            res["paths"][name] = {"status": f"error: {type(e).__name__}: {str(e)[:400]}"}
    summarize(res, row, copy_gbps)
    return res


def _median(res, path):
    return res["paths"].get(path, {}).get("median_s")


def summarize(res: dict, row: Row, copy_gbps: float) -> None:
    ours, kern = _median(res, "ours"), _median(res, "ours_kernels")
    valid = all(res["error"].get(p, {"ok": True})["ok"] for p in ("ours", "ours_kernels")) and "ours" in res["error"]
    res["valid"] = valid
    res["time_s"] = ours
    res["kernels_time_s"] = kern
    res["ratio"] = {b: (_median(res, b) / ours if ours and _median(res, b) and valid else None)
                    for b in ("sdpa", "flex")}
    res["ratio_graph"] = {"sdpa": (_median(res, "sdpa_graph") / kern if kern and _median(res, "sdpa_graph") and valid
                                   else None)}
    frac = lambda t: row.bytes() / t / (copy_gbps * 1e9) if t else None  # noqa: E731
    res["bandwidth_fraction"] = {"call": frac(ours), "kernels": frac(kern)}
    res["tflops"] = {"call": row.flops() / ours / 1e12 if ours else None,
                     "kernels": row.flops() / kern / 1e12 if kern else None}
    if row.kind == "decode" and row.S >= GOAL_MIN_S:
        f = res["bandwidth_fraction"]["kernels"] or res["bandwidth_fraction"]["call"]
        res["goal"] = "NOT MET (wrong result)" if not valid else (
            "NOT MET (not timed)" if f is None else ("MET" if f >= GOAL_FRACTION else "NOT MET"))
    else:
        res["goal"] = None


class Budget:
    """Estimates a row's time from the last row of its kind; skips what would end past the budget."""

    def __init__(self, budget_s: float, cuda: bool):
        self.budget_s, self.last = budget_s, {}
        self.default = {"decode": 15.0, "prefill": 25.0} if cuda else {"decode": 3.0, "prefill": 3.0}
        self.calls = 10  # calls of the slowest path a row makes when each is slow (the least rounds)

    def estimate(self, row: Row) -> float:
        prev = self.last.get(row.kind)
        if prev is None:
            return self.default[row.kind]
        prev_row, res = prev
        grow = max(0.0, row.work() / prev_row.work() - 1.0)
        return res["row_s"] + self.calls * res["slowest_call_s"] * grow

    def record(self, row: Row, res: dict):
        self.last[row.kind] = (row, res)

    def verdict(self, row: Row):
        elapsed, est = time.monotonic() - T0, self.estimate(row)
        if elapsed + est > self.budget_s:
            return f"budget: {elapsed:.0f} s elapsed + {est:.0f} s estimated > --budget-s {self.budget_s:.0f}"
        return None


def run(args) -> int:
    torch, cuda = import_torch(args.dry_run)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference in float32
        torch.backends.cudnn.allow_tf32 = False
    notes = []
    paged = import_paged(notes)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {"schema": 1, "mode": "dry-run" if args.dry_run else ("gpu" if cuda else "cpu"),
              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "argv": sys.argv[1:], "budget_s": args.budget_s,
              "goal": {"text": GOAL_TEXT, "target": GOAL_FRACTION}, "rows": [], "skipped": [], "notes": notes}
    report["device"] = device_facts(torch, cuda, args.dry_run)
    print(f"h200: {report['device']['name']}, torch {report['device']['torch']}, triton {report['device']['triton']}",
          flush=True)
    clock = Clock(torch, cuda)
    report["bandwidth"] = measure_bandwidth(torch, cuda, clock)
    if cuda:
        torch.cuda.empty_cache()
    bw = report["bandwidth"]
    print(f"h200: copy {bw['copy_gbps']:.0f} GB/s read+written ({bw['read_gbps']:.0f} GB/s read)", flush=True)
    if not cuda and not args.dry_run:
        notes.append("no CUDA device: the CPU under the Triton interpreter (times mean nothing)")
    flex = None if args.no_flex else Flex(torch, compiled=cuda)
    budget = Budget(args.budget_s, cuda)
    rows = dry_rows() if (args.dry_run or not cuda) else gpu_rows()
    for row in rows:
        if args.only and not re.search(args.only, row.name):
            report["skipped"].append({"name": row.name, "reason": f"--only {args.only}"})
            continue
        why = budget.verdict(row)
        if why:
            report["skipped"].append({"name": row.name, "reason": why})
            print(f"h200: skip {row.name}: {why}", flush=True)
            continue
        try:
            res = run_row(torch, paged, row, clock, flex, bw["copy_gbps"], cuda)
        except Exception as e:  # noqa: BLE001 -- one row's failure is recorded, the run goes on
            res = {"name": row.name, **asdict(row), "L": row.L, "valid": False, "time_s": None, "ratio": {},
                   "error": {}, "goal": "NOT MET (error)" if row.kind == "decode" and row.S >= GOAL_MIN_S else None,
                   "failure": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:],
                   "row_s": 0.0, "slowest_call_s": 0.0}
            if cuda:
                torch.cuda.empty_cache()
        report["rows"].append(res)
        budget.record(row, res)
        print("h200: " + row_line(res), flush=True)
        write(report, out_dir)  # what is done so far survives a kill
    judged = [r for r in report["rows"] if r.get("goal")]
    report["goal"].update(rows=len(judged), met=sum(r["goal"] == "MET" for r in judged),
                          status=None if args.dry_run or not judged else
                          ("MET" if all(r["goal"] == "MET" for r in judged) else "NOT MET"))
    if args.dry_run:
        report["goal"]["note"] = "dry run: no bandwidth goal"
    report["elapsed_s"] = time.monotonic() - T0
    write(report, out_dir)
    print(f"h200: {len(report['rows'])} rows, {len(report['skipped'])} skipped, {report['elapsed_s']:.0f} s; "
          f"goal: {report['goal'].get('status')}; {out_dir / 'h200.md'}", flush=True)
    wrong = [r["name"] for r in report["rows"] if not r.get("valid")]
    return 1 if wrong else 0


# --- report ------------------------------------------------------------------------------------------------

def _us(t):
    return "-" if t is None else f"{t * 1e6:.1f}"


def _x(r):
    return "-" if r is None else f"{r:.2f}x"


def _pct(f):
    return "-" if f is None else f"{f:.0%}"


def _path(res, name):
    p = res.get("paths", {}).get(name, {})
    return _us(p["median_s"]) if "median_s" in p else (p.get("status", "-")[:40] or "-")


def row_line(res) -> str:
    if res.get("failure"):
        return f"{res['name']}: FAILED {res['failure']}"
    err = res["error"].get("ours", {})
    return (f"{res['name']}: ours {_us(res['time_s'])} us (kernels {_us(res.get('kernels_time_s'))}), "
            f"sdpa {_path(res, 'sdpa')} ({_x(res['ratio'].get('sdpa'))}), flex {_path(res, 'flex')} "
            f"({_x(res['ratio'].get('flex'))}), bw {_pct(res['bandwidth_fraction']['kernels'])} kernels / "
            f"{_pct(res['bandwidth_fraction']['call'])} call, err {err.get('max_abs', float('nan')):.2e} "
            f"{'ok' if res['valid'] else 'WRONG'}" + (f", goal {res['goal']}" if res.get("goal") else ""))


def markdown(report) -> str:
    d, bw, goal = report["device"], report["bandwidth"], report["goal"]
    gpu = report["mode"] == "gpu"
    timing = ("CUDA events around each call after an L2 flush" if gpu else
              "time.perf_counter per call; no CUDA graphs: `ours kernels` runs the launches directly")
    flex_mode = "torch.compile" if gpu else "eager"
    lines = [f"# Paged attention (gpu/paged.py) on {d['name']}", "",
             f"torch {d['torch']}, triton {d['triton']}, CUDA {d.get('cuda_runtime')}, Python {d['python']}; "
             f"SMs {d.get('sm_count')}, memory {d.get('memory_gib', '-')} GiB, L2 {d.get('l2_cache_mib', '-')} MiB; "
             f"mode {report['mode']}; {report.get('elapsed_s', 0):.0f} s of --budget-s {report['budget_s']:.0f}.", "",
             f"Measured copy bandwidth: **{bw['copy_gbps']:.0f} GB/s** of bytes read + written "
             f"({bw['read_gbps']:.0f} GB/s of bytes read; {bw['bytes_copied'] / 2**30:.2f} GiB copied, median of "
             f"{bw['rounds']}). Every bandwidth fraction below is a row's bytes (K/V of the context + query + "
             f"output) / time / this copy bandwidth.", "",
             f"Goal: {goal['text']} -- **{goal.get('status') or goal.get('note', 'not judged')}** "
             f"({goal.get('met', 0)} of {goal.get('rows', 0)} rows; judged on `ours kernels`, the device time of the "
             "call's launches (`gpu.paged.plan`) replayed from a CUDA graph; `call` is the whole eager call, its "
             "checks' host read included).", "",
             f"Times in us (median; {timing}). Ratio = baseline / ours (> 1: ours faster); "
             "eager calls against eager calls, `graph` = SDPA graph / ours kernels graph. Error: ours against a "
             f"float32 reference on the gathered K/V (max abs; OK when each output row's error <= {TOL_EPS} eps of "
             "the dtype times the row's largest |value|).", "",
             f"| row | ours call | ours kernels | SDPA | ratio | SDPA graph | ratio graph | Flex ({flex_mode}) | ratio "
             "| BW kernels / call | TFLOP/s | max abs err | check | goal |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        if r.get("failure"):
            lines.append(f"| {r['name']} | FAILED: {r['failure'][:120]} |" + " |" * 12 + f" {r.get('goal') or ''} |")
            continue
        e = r["error"].get("ours", {})
        tf = r["tflops"]["kernels"] or r["tflops"]["call"]
        lines.append(
            f"| {r['name']} | {_us(r['time_s'])} | {_path(r, 'ours_kernels')} | {_path(r, 'sdpa')} | "
            f"{_x(r['ratio'].get('sdpa'))} | {_path(r, 'sdpa_graph')} | {_x(r['ratio_graph'].get('sdpa'))} | "
            f"{_path(r, 'flex')} | {_x(r['ratio'].get('flex'))} | {_pct(r['bandwidth_fraction']['kernels'])} / "
            f"{_pct(r['bandwidth_fraction']['call'])} | {'-' if tf is None else f'{tf:.1f}'} | "
            f"{e.get('max_abs', float('nan')):.2e} | {'OK' if r['valid'] else 'WRONG'} | {r.get('goal') or ''} |")
    lines += ["", "Baselines' errors against the same reference (max abs / row-relative):", ""]
    for r in report["rows"]:
        errs = ", ".join(f"{p} {v['max_abs']:.2e} / {v['max_rel_row']:.1e}{'' if v['ok'] else ' (over tol)'}"
                         for p, v in r.get("error", {}).items())
        extra = ""
        if r.get("flex_first_call_s") is not None:
            extra = f"; flex first call (compile) {r['flex_first_call_s']:.1f} s"
        if r.get("ours_first_call_s") is not None:
            extra += f"; ours first call {r['ours_first_call_s']:.2f} s; row {r.get('row_s', 0):.1f} s"
        lines.append(f"- {r['name']}: {errs or '-'}{extra}")
    lines += ["", f"Skipped rows ({len(report['skipped'])}):", ""]
    lines += [f"- {s['name']}: {s['reason']}" for s in report["skipped"]] or ["- none"]
    if report["notes"]:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in report["notes"]]
    return "\n".join(lines) + "\n"


def write(report, out_dir: Path) -> None:
    report["elapsed_s"] = time.monotonic() - T0
    (out_dir / "h200.json").write_text(json.dumps(report, indent=1, default=str))
    (out_dir / "h200.md").write_text(markdown(report))


# --- compute-sanitizer's case -----------------------------------------------------------------------------

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


def main(argv=None) -> int:
    args = parse(argv)
    if args.memcheck_case:
        return memcheck_case()
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
