"""The measured run: the arguments, the rows in order within the budget, the report."""

from __future__ import annotations

import argparse
import re
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path

import gpu.h200 as package
from gpu.h200.backend import import_paged, import_torch
from gpu.h200.baselines import Flex
from gpu.h200.clock import Budget, Clock
from gpu.h200.measure import device_facts, measure_bandwidth, run_row
from gpu.h200.memcheck import memcheck_case
from gpu.h200.report import row_line, write
from gpu.h200.rows import GOAL_FRACTION, GOAL_MIN_S, GOAL_TEXT, dry_rows, gpu_rows


def parse(argv=None):
    p = argparse.ArgumentParser(prog="python -m gpu.h200", description=package.__doc__.splitlines()[0])
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
    write(report, out_dir)  # sets elapsed_s
    print(f"h200: {len(report['rows'])} rows, {len(report['skipped'])} skipped, {report['elapsed_s']:.0f} s; "
          f"goal: {report['goal'].get('status')}; {out_dir / 'h200.md'}", flush=True)
    wrong = [r["name"] for r in report["rows"] if not r.get("valid")]
    return 1 if wrong else 0


def main(argv=None) -> int:
    args = parse(argv)
    if args.memcheck_case:
        return memcheck_case()
    return run(args)
