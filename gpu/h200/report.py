"""The run's report: a line a row as it goes, and h200.json / h200.md."""

from __future__ import annotations

import json
import time
from pathlib import Path

from gpu.h200.clock import T0
from gpu.h200.reference import TOL_EPS


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
