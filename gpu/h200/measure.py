"""One row measured: every path checked against the reference, then timed; the machine's facts
and the copy bandwidth every fraction is relative to."""

from __future__ import annotations

import os
import platform
import time
from dataclasses import asdict

from gpu.h200.baselines import Flex, sdpa_call
from gpu.h200.clock import Clock, summary
from gpu.h200.reference import compare, gather, make_case, reference_batch
from gpu.h200.rows import GOAL_FRACTION, GOAL_MIN_S, Row


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
        timing = summary(times, "cuda events")
    else:
        timing = clock.measure(lambda: dst.copy_(src))
    t = timing["median_s"]
    out = {"bytes_copied": n, "median_s": t, "rounds": timing["rounds"], "method": timing["method"],
           "copy_gbps": 2 * n / t / 1e9, "read_gbps": n / t / 1e9,
           "note": "copy_gbps counts bytes read + written (the denominator of the bandwidth fractions); "
                   "read_gbps the bytes read alone"}
    return out  # the buffers go with this frame (run() empties torch's cache after)


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
