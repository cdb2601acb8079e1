"""The benchmark report: the grid, the write path and the serving trace in one run.

    python -m bench.report [--quick | --level LEVEL] [--json PATH] [--plot PNG] [--readme]

Runs bench/grid.py's level (full; quick: at most 5 minutes on the 2-core machine; long:
the L = S = 8192 prefill sweep alone, its attention cases and nothing else), prints a
table and the goals (bench/goals.py), writes the JSON and the plot; `--readme` then
rewrites README.md's results (bench/readme.py: a long sweep has its own region). The
machine's limits are measured at the start and the end of the run (bench/machine.py; the
higher of each is used).

JSON: `machine` (versions, threads), `limits`, `level`, `cases` (one per op x path x
case, timed or `"skipped": reason`), `overhead` (bench/overhead.py: the per-call cost of
validation, one row per batch size), `layers` (bench/layers.py: small decode calls alone
and a layer stack's worth in one graph, beside vLLM), `serving` (bench/serving.py's report and its
ratios), `goals`, `wall_s`. A timed case has:

| field                              | meaning                                                   |
|------------------------------------|-----------------------------------------------------------|
| `op`, `path`, `batch`, `context`, `page_size`, `dtype`, `query_len` | the call (write: `tokens`, `pool_mib`) |
| `median_s`, `p95_s`, `min_s`, `rounds` | latency over the timed rounds (after one warm-up)        |
| `bytes`, `gbytes_per_s`            | K/V read + Q + O + table entries (write: rows written), over the median |
| `read_gbytes_per_s` (decode)       | the read limit's stream (bench/machine.py) timed in turns beside this case: its median rate |
| `round_trip_median_s` (decode)     | a trivial op evaluated on the kernels' MLX stream (machine.StreamRoundTrip), timed in the same turns: the floor of any call through MLX |
| `bandwidth_fraction` (decode)      | gbytes_per_s / read_gbytes_per_s (the same load on both)  |
| `cached_gbytes_per_s`, `cached_case` (decode from DRAM, the serving path's row) | its cached twin (bench/cached.py: the serving path on 8 MiB of K/V of the same dtype and page size, which stay in the cache) timed in the same turns: the rate of its loops when memory never makes them wait |
| `limit_fraction` (decode)          | gbytes_per_s / the run's best read rate (`limits`)          |
| `flops`, `gflops`, `flops_fraction` (prefill) | causal QK^T + PV FLOPs over the median, / measured sgemm |
| `fma_fraction` (prefill)           | gflops / the measured FMA peak of the kernels' threads (above 1: not float32 FMAs) |
| `paged_speedup`                    | this path's median / paged's median on the same case (vllm_cpu: vLLM / pagecheck, above 1: pagecheck faster) |
| `metadata_median_s`, `metadata_p95_s` (vllm_cpu) | vLLM's per-step `get_scheduler_metadata` alone, timed in the same turns (not in `median_s`) |
| `order` (vllm_cpu)                 | timing.order_check(paged, vllm_cpu): vLLM / paged timed interleaved and in blocks, and whether they agree |

vllm_cpu is an optional extra (bench/grid.py): where vLLM CPU's ops cannot be loaded its
rows are `"skipped": reason` and its goals are not measured.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import impl

from . import goals as goals_mod
from . import cached, grid, layers, machine, overhead, paths, timing, write
from .readme import median_cell as _ms


READ = "read"  # the read limit's stream, timed beside each decode (and mixed) case
ROUND_TRIP = "stream round trip"  # machine.StreamRoundTrip, timed beside the same cases
CACHED = "cached twin"  # cached.Twins: a decode from DRAM's loops from cache, timed beside it
VLLM_METADATA = "vllm_cpu metadata"  # vLLM's per-step metadata build, timed beside its kernel
ORDER_MAX_ROUNDS = 300  # per order in timing.order_check (paged vs vllm_cpu)


def attention_cases(level: str, log=print) -> list[dict]:
    """Times every case's paths in turns (timing.side_by_side); a decode case also times
    the read limit's stream (machine.ReadStream) in the same turns, and its rows carry
    that read's rate as `read_gbytes_per_s`: a burst of load from another job then slows
    the decode and the reference alike instead of the decode alone. A decode that reads
    at least the stream's bytes (from DRAM) also times its cached twin in those turns
    (bench/cached.py), and the serving path's row carries the twin's rate as
    `cached_gbytes_per_s`."""
    specs = grid.attention_specs(level)
    reader = machine.ReadStream(impl.num_threads()) if any(s.op in grid.BANDWIDTH_OPS for s in specs) else None
    twins = cached.Twins(specs, reader.nbytes if reader is not None else float("inf"))
    pools, rows = paths.Pools(specs), []
    round_trip = machine.StreamRoundTrip()
    try:
        for spec in specs:
            skipped = {path: grid.skip_reason(spec, path) for path in grid.PATHS}
            timed = [path for path in grid.PATHS if skipped[path] is None]
            runs = {path: paths.make(path, pools.case_for(spec, path), spec.rows) for path in timed}
            ours = cached.serving_path(spec)  # the pagecheck path the goals judge on this shape
            if spec.op in grid.BANDWIDTH_OPS:
                runs[READ] = reader
                runs[ROUND_TRIP] = round_trip
            twin = twins.for_spec(spec)
            if twin is not None:
                runs[CACHED] = twin[1]
            if "vllm_cpu" in runs:
                runs[VLLM_METADATA] = runs["vllm_cpu"].metadata
            times = timing.side_by_side(runs, level)
            extra = {}
            if "vllm_cpu" in runs and "paged" in runs:
                # the order check on the pagecheck path the vLLM goals judge on this shape
                meta = timing.summary(times[VLLM_METADATA])
                rounds = min(len(times[ours]), len(times["vllm_cpu"]), ORDER_MAX_ROUNDS)
                extra = {"metadata_median_s": meta["median_s"], "metadata_p95_s": meta["p95_s"],
                         "order": {**timing.order_check(runs[ours], runs["vllm_cpu"], rounds), "path": ours}}
            read = {}
            if READ in times:
                read["read_gbytes_per_s"] = reader.nbytes / timing.summary(times[READ])["median_s"] / 1e9
                read["round_trip_median_s"] = timing.summary(times[ROUND_TRIP])["median_s"]
            own = {}  # the twin is the serving path's loops: on that path's row only
            if CACHED in times:
                own = {"cached_gbytes_per_s": twin[0].io_bytes() / timing.summary(times[CACHED])["median_s"] / 1e9,
                       "cached_case": twin[0].id}
            for path in grid.PATHS:
                row = {**spec.describe(), "path": path}
                if skipped[path]:
                    rows.append({**row, "skipped": skipped[path]})
                    continue
                row.update(timing.summary(times[path]), bytes=spec.io_bytes(path), flops=spec.flops(), **read)
                if path == "vllm_cpu":
                    row.update(extra)
                if own and path == ours:
                    row.update(own)
                rows.append(row)
                log(f"  {spec.id:<36} {path:<13} {row['median_s'] * 1e3:10.3f} ms  ({row['rounds']} rounds)")
            del runs, times
    finally:
        if reader is not None:
            reader.close()
    return rows


def _derive(cases: list[dict], limits: dict) -> None:
    paged = {(c["op"], c["batch"], c["context"], c["page_size"], c["dtype"]): c["median_s"]
             for c in cases if c["path"] == "paged" and "median_s" in c and c["op"] != "write"}
    for c in cases:
        if "median_s" not in c:
            continue
        c["gbytes_per_s"] = c["bytes"] / c["median_s"] / 1e9
        if c["op"] == "write":
            c["bandwidth_fraction"] = c["gbytes_per_s"] / limits["read_gbytes_per_s"]
            continue
        if c["op"] in grid.BANDWIDTH_OPS:
            c["bandwidth_fraction"] = c["gbytes_per_s"] / c.get("read_gbytes_per_s", limits["read_gbytes_per_s"])
            c["limit_fraction"] = c["gbytes_per_s"] / limits["read_gbytes_per_s"]
        c["gflops"] = c["flops"] / c["median_s"] / 1e9
        if c["op"] == "prefill":
            c["flops_fraction"] = c["gflops"] / limits["sgemm_gflops"]
            c["fma_fraction"] = c["gflops"] / limits["fma_gflops"]
        base = paged.get((c["op"], c["batch"], c["context"], c["page_size"], c["dtype"]))
        if base:
            c["paged_speedup"] = c["median_s"] / base


def serving_section(level: str) -> dict:
    from . import serving
    trace = serving.DEFAULT if level == "full" else serving.QUICK
    out = serving.run(trace)
    v = out["variants"]
    out["trace_name"] = f"{'default' if level == 'full' else 'quick'} trace {out['trace']['digest']}"
    out["ratios"] = {key: v["paged"][key] / v["dense"][key] for key in
                     ("decode_tok_s", "prefill_tok_s", "requests_s", "peak_kv_bytes", "peak_kv_fitted_bytes",
                      "peak_kv_filled_bytes")}
    out["ratios"]["paged_gather_decode_tok_s"] = v["paged_gather"]["decode_tok_s"] / v["dense"]["decode_tok_s"]
    out["table"] = serving.table(out)
    return out


def run(level: str, *, with_serving: bool = True, log=print) -> dict:
    """The level's report; the long sweep times its attention cases alone (no write path,
    overhead or serving trace: those are the other levels')."""
    t0 = time.perf_counter()
    sweep_only = level == "long"
    log(f"machine limits ({level} run) ...")
    first = machine.limits()
    log(f"attention grid ({len(grid.attention_specs(level))} cases x {len(grid.PATHS)} paths) ...")
    cases = attention_cases(level, log)
    if not sweep_only:
        log("write path ...")
        cases += write.run(level)
    limits = machine.best_of(first, machine.limits())
    _derive(cases, limits)
    report = {"machine": machine.info(), "limits": limits, "level": level, "cases": cases}
    if not sweep_only:
        log("per-call overhead ...")
        report["overhead"] = overhead.run(level)
        log("small decode calls alone and in a graph ...")
        report["layers"] = layers.run(level)
    if with_serving and not sweep_only:
        log("serving trace ...")
        report["serving"] = serving_section(level)
    report["goals"] = goals_mod.evaluate(report)
    report["wall_s"] = time.perf_counter() - t0
    return report


def table(report: dict) -> str:
    lim = report["limits"]
    lines = [f"limits: read {lim['read_gbytes_per_s']:.1f} GB/s, sgemm {lim['sgemm_gflops']:.0f} GFLOP/s, "
             f"FMA peak {lim['fma_gflops']:.0f} GFLOP/s, "
             f"{lim['threads']} threads, load average {lim['load_average']}; median ms (x: path / paged)",
             f"{'case':<34}{'paged':>10}{'frac':>7}" + "".join(f"{p:>17}" for p in grid.PATHS[1:])]
    by_case = {}
    for c in report["cases"]:
        if c["op"] != "write":
            by_case.setdefault((c["op"], c["batch"], c["context"], c["page_size"], c["dtype"]), {})[c["path"]] = c
    for (op, b, s, ps, dt), row in by_case.items():
        p = row.get("paged", {})
        frac = p.get("bandwidth_fraction", p.get("flops_fraction"))
        lines.append(f"{f'{op} B{b} S{s} ps{ps} {dt}':<34}{_ms(p):>10}{'' if frac is None else f'{frac:.0%}':>7}"
                     + "".join(f"{_ms(row.get(path)):>17}" for path in grid.PATHS[1:]))
    for c in report["cases"]:
        if c["op"] == "write":
            lines.append(f"write {c['tokens']:>3} token(s), {c['pool_mib']:>4} MiB pool: {c['median_s'] * 1e6:8.1f} us"
                         f"  (x{c['ratio_vs_smallest_pool']:.2f} of the smallest pool)")
    for r in report.get("overhead", []):
        lines.append(f"overhead B{r['batch']} S{r['context']}: paged_attention {r['paged_median_s'] * 1e6:.1f} us - "
                     f"with_metadata {r['with_metadata_median_s'] * 1e6:.1f} us = {r['overhead_s'] * 1e6:.1f} us "
                     f"(the calls alone {r['paged_host_median_s'] * 1e6:.1f} / "
                     f"{r['with_metadata_host_median_s'] * 1e6:.1f} us; validation alone "
                     f"{r['validation_median_s'] * 1e6:.1f} us, build {r['build_median_s'] * 1e6:.1f} us)")
    lines += layers.lines(report.get("layers", []))
    lines += vllm_lines(report["cases"])
    if "serving" in report:
        lines += ["", "serving: " + report["serving"]["table"]]
    lines.append("")
    for g in report["goals"]:
        measured, target = goals_mod.describe(g)
        lines.append(f"{g['goal']:<48} {measured:>8}  goal {target:<8} {goals_mod.verdict(g):<8} {g['detail']}")
    lines.append(f"wall time {report['wall_s']:.0f} s")
    return "\n".join(lines)


def vllm_lines(cases: list[dict]) -> list[str]:
    """vLLM CPU / pagecheck per shape (above 1: pagecheck faster), the interleaved and
    blocked ratios of the order check, and vLLM's metadata build; one line when skipped."""
    rows = [c for c in cases if c["path"] == "vllm_cpu"]
    timed = [c for c in rows if "paged_speedup" in c]
    if not timed:
        return [f"vllm_cpu: skipped: {rows[0]['skipped']}"] if rows and "skipped" in rows[0] else []
    median_of = {(c["path"], c["op"], c["batch"], c["context"], c["page_size"], c["dtype"]): c["median_s"]
                 for c in cases if "median_s" in c and "batch" in c}  # write cases have no batch
    lines = ["", "vLLM CPU / pagecheck paged_attention_with_metadata, median (above 1: pagecheck faster), and "
             "against paged_now and packed pages where timed; order check of the serving path against vLLM: "
             f"interleaved / blocked (flagged beyond {timing.ORDER_TOLERANCE:.0%}); vLLM metadata"]
    for c in rows:
        name = f"{c['op']} B{c['batch']} S{c['context']} ps{c['page_size']} {c['dtype']}"
        if "skipped" in c:
            lines.append(f"  {name:<34} skipped: {c['skipped']}")
            continue
        if "paged_speedup" not in c:
            continue
        o = c.get("order")
        order = "" if not o else (f"  order ({o.get('path', 'paged')}) {o['interleaved_ratio']:.2f}x / "
                                  f"{o['blocked_ratio']:.2f}x" + ("" if o["agree"] else "  DISAGREE"))
        meta = f"  metadata {c['metadata_median_s'] * 1e6:.1f} us" if "metadata_median_s" in c else ""
        shape = (c["op"], c["batch"], c["context"], c["page_size"], c["dtype"])
        serving = "".join(f"  {label}: {c['median_s'] / median_of[(path, *shape)]:.2f}x"
                          for path, label in (("paged_now", "now"), ("paged_packed", "packed pages"))
                          if (path, *shape) in median_of)
        lines.append(f"  {name:<34} {c['paged_speedup']:6.2f}x{serving}{order}{meta}")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    levels = parser.add_mutually_exclusive_group()
    levels.add_argument("--quick", action="store_true", help="the quick grid (at most 5 minutes here)")
    levels.add_argument("--level", choices=("quick", "full", "long"), default="full",
                        help="the grid's level (bench/grid.py; default full; long: the L = S = 8192 prefill sweep)")
    parser.add_argument("--json", metavar="PATH", help="write the report as JSON here")
    parser.add_argument("--plot", metavar="PNG", help="plot latency against context per path (needs matplotlib)")
    parser.add_argument("--readme", nargs="?", const="README.md", metavar="README",
                        help="rewrite the results in README.md (or this file) from the report")
    args = parser.parse_args(argv)
    report = run("quick" if args.quick else args.level, log=lambda m: print(m, file=sys.stderr, flush=True))
    if args.json:  # first: a run of many minutes is kept even if a summary below fails
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    print(table(report))
    if args.plot:
        from .plot import plot
        print(plot(report, args.plot))
    if args.readme:
        from .readme import rewrite
        rewrite(args.readme, report)
        print(f"rewrote the benchmark results in {args.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
