"""The serving trace: paged vs paged-then-gather vs dense serving on one workload.

    python -m bench.serving [--quick] [--json PATH]

Runs the deterministic trace of `fixtures.trace.Trace` (its digest is recorded) through
the one scheduler with each variant's store and engine (see impl/engine.py), checks that
every variant produced the same output bits for every (request, layer, position), and
then sweeps a fixed KV budget to count the requests each variant admits at once.

Timing covers scheduling and the engines' work with its evaluation; synthesizing the
trace's Q/K/V is outside it. Figures are only comparable within one run.

| field              | meaning                                                           |
|--------------------|-------------------------------------------------------------------|
| `prefill_tok_s`    | prompt positions (recompute included) per second of prefill work  |
| `decode_tok_s`     | decode positions per second of decode work                        |
| `requests_s`       | requests finished per second of timed work                        |
| `decode_step_ms`   | one step's decode group over all layers: median, p95, max         |
| `peak_kv_bytes`    | most K/V bytes committed at once: live pages (paged) or the up-front slots (dense: `max_seq_len` = longest prompt + output cap of the trace, per running request, as serving before paging), plus one layer's gathered or repacked batch |
| `peak_kv_fitted_bytes` | the same with dense reserving only prompt + max_new_tokens per request (a dense server that knows each request's bound) |
| `peak_kv_filled_bytes` | the same with dense counting only the positions written so far (its arrays grow by concatenation) |
| `peak_live_pages`  | most pages live at once (null for dense: it has none)             |
| `kv_bytes_copied`  | K/V bytes moved besides writing the new rows: copy-on-write, gathers, concatenations, repacks |
| `page_reuses`      | allocations of a page that had been freed before (null for dense) |
| `tail_waste_slots` | most slots held but unused at once: page tails (paged) or reserved, unwritten positions (dense) |
| `leaked_pages`     | live pages that no request holds once the trace is done           |
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
import zlib

import mlx.core as mx
import numpy as np

from fixtures.serving import scheduled_steps
from fixtures.trace import Trace
from impl.engine import VARIANTS, make_engine, step_groups
from impl.pool import PagePool, pool_copies
from impl.scheduler import Request, Scheduler
from impl.stores import DenseStore, PagedStore

DEFAULT = Trace()
QUICK = Trace(num_requests=8, prompt_range=(64, 512), output_range=(16, 64), layers=2)


def make_store(trace: Trace, variant: str, budget_tokens: int, **pool_options):
    if variant == "dense":
        return DenseStore(num_layers=trace.layers, kv_heads=trace.kv_heads, head_dim=trace.head_dim,
                          dtype=trace.mx_dtype, budget_tokens=budget_tokens, slot_tokens=trace.max_seq_len)
    pool = PagePool(num_layers=trace.layers, kv_heads=trace.kv_heads, head_dim=trace.head_dim,
                    page_size=trace.page_size, dtype=trace.mx_dtype, num_pages=budget_tokens // trace.page_size,
                    **pool_options)
    return PagedStore(pool)


def default_budget(trace: Trace) -> int:
    """Tokens (per layer) that hold `batch` requests of the longest kind: no preemption."""
    return trace.batch * -(-trace.max_seq_len // trace.page_size) * trace.page_size


def run_variant(trace: Trace, variant: str, budget_tokens: int | None = None, emit=None, on_step=None,
                **pool_options):
    """Runs the whole trace; returns (metrics, {(rid, layer, position): crc32 of the output row}).

    `emit(rid, layer, position, row)`, if given, sees every output row as it is produced
    (a recomputed position comes again; the digest keeps the last); `on_step(scheduler,
    store, step)` runs after every completed step (tests check invariants there);
    `pool_options` go to the `PagePool` (fill, poison_freed).
    """
    store = make_store(trace, variant, budget_tokens or default_budget(trace), **pool_options)
    engine = make_engine(variant, store)
    sched = Scheduler(store, max_batch=trace.batch, prefill_step=trace.prefill_step)
    for rid, prompt, output in trace.requests():
        sched.add(Request(rid, prompt, trace.max_new_tokens, output))
    copies_before = pool_copies()
    timed = {"prefill": 0.0, "decode": 0.0, "schedule": 0.0}
    tokens = {"prefill": 0, "decode": 0}
    decode_steps, digests = [], {}
    peak_kv = peak_fitted = peak_filled = peak_waste = 0
    steps = scheduled_steps(sched)
    while True:
        t0 = time.perf_counter()
        step = next(steps, None)
        timed["schedule"] += time.perf_counter() - t0
        if step is None:
            break
        for group in step_groups(step):
            inputs = trace.group_inputs(group)
            mx.eval(inputs)
            kind = "decode" if group[0].decode else "prefill"
            t0 = time.perf_counter()
            outs = engine.run_group(group, inputs)
            mx.eval(outs)
            elapsed = time.perf_counter() - t0
            timed[kind] += elapsed
            tokens[kind] += sum(w.count for w in group)
            if kind == "decode":
                decode_steps.append(elapsed * 1e3)
            _record(digests, group, outs, emit)
            peak_kv = max(peak_kv, store.held_bytes() + engine.last_transient_bytes)
            peak_fitted = max(peak_fitted, store.fitted_bytes() + engine.last_transient_bytes)
            peak_filled = max(peak_filled, store.kv_bytes() + engine.last_transient_bytes)
        peak_waste = max(peak_waste, store.tail_waste_slots())
        t0 = time.perf_counter()
        sched.complete(step)
        timed["schedule"] += time.perf_counter() - t0
        if on_step is not None:
            on_step(sched, store, step)
    paged = variant != "dense"
    stats = store.pool.stats() if paged else None
    total = sum(timed.values())
    metrics = {
        "prefill_tok_s": tokens["prefill"] / timed["prefill"] if timed["prefill"] else 0.0,
        "decode_tok_s": tokens["decode"] / timed["decode"] if timed["decode"] else 0.0,
        "requests_s": len(sched.done) / total,
        "decode_step_ms": _summary(decode_steps),
        "peak_kv_bytes": int(peak_kv),
        "peak_kv_fitted_bytes": int(peak_fitted),
        "peak_kv_filled_bytes": int(peak_filled),
        "peak_live_pages": stats.peak_live if paged else None,
        "kv_bytes_copied": int(engine.kv_bytes_copied + (stats.pages_copied * store.pool.bytes_per_page if paged else 0)),
        "page_reuses": stats.reuses if paged else None,
        "tail_waste_slots": int(peak_waste),
        "leaked_pages": store.leaked_pages(),
        "preemptions": sum(r.preemptions for r in sched.done),
        "whole_pool_copies": pool_copies() - copies_before,
        "seconds": total,
    }
    return metrics, digests


def _record(digests, group, outs, emit) -> None:
    for layer, out in enumerate(outs):
        rows = np.array(out)  # [B, Hq, L, D]
        for b, work in enumerate(group):
            for i in range(work.count):
                key = (work.request.rid, layer, work.start + i)
                digests[key] = zlib.crc32(rows[b, :, i].tobytes())
                if emit is not None:
                    emit(*key, rows[b, :, i])


def _summary(values) -> dict:
    if not values:
        return {"median": 0.0, "p95": 0.0, "max": 0.0}
    ordered = sorted(values)
    return {"median": statistics.median(ordered), "p95": ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))],
            "max": ordered[-1]}


def admission_sweep(trace: Trace, fractions=(0.25, 0.5, 1.0)) -> list[dict]:
    """At fixed KV budgets, the most requests each variant runs at once (batch unbounded).

    Only the stores' admission decides, so no attention runs: each step is scheduled and
    completed as if its work were done.
    """
    rows = []
    for fraction in fractions:
        budget = max(trace.page_size, int(default_budget(trace) * fraction) // trace.page_size * trace.page_size)
        row = {"budget_tokens": budget, "budget_bytes": budget * 2 * trace.layers * trace.kv_heads *
               trace.head_dim * trace.mx_dtype.size}
        for variant in VARIANTS:
            store = make_store(trace, variant, budget)
            sched = Scheduler(store, max_batch=trace.num_requests, prefill_step=trace.prefill_step)
            skipped = 0
            for rid, prompt, output in trace.requests():
                if store.could_ever_hold(Request(rid, prompt, trace.max_new_tokens, output)):
                    sched.add(Request(rid, prompt, trace.max_new_tokens, output))
                else:
                    skipped += 1
            for step in scheduled_steps(sched):
                sched.complete(step)
            row[variant] = {"peak_running": sched.peak_running, "never_fit": skipped,
                            "preemptions": sum(r.preemptions for r in sched.done)}
        rows.append(row)
    return rows


def run(trace: Trace) -> dict:
    # Warm every path (thread pool, allocator caches, page faults) before timing anything.
    warm = dataclasses.replace(trace, num_requests=2, prompt_range=(trace.prefill_step + 1,) * 2,
                               output_range=(4, 4))
    for variant in VARIANTS:
        run_variant(warm, variant)
    results, reference = {}, None
    for variant in VARIANTS:
        metrics, digests = run_variant(trace, variant)
        if reference is None:
            reference = digests
        elif digests != reference:
            differ = sorted(k for k in reference if digests.get(k) != reference[k])[:5]
            raise AssertionError(f"variant {variant} disagrees with {VARIANTS[0]} at {differ} "
                                 f"(request, layer, position)")
        results[variant] = metrics
    return {"trace": {**trace.describe(), "digest": trace.digest(), "requests": len(trace.requests()),
                      "budget_tokens": default_budget(trace), "max_seq_len": trace.max_seq_len},
            "outputs_agree": True, "positions_checked": len(reference),
            "variants": results, "admission_sweep": admission_sweep(trace)}


def table(report: dict) -> str:
    v = report["variants"]
    cols = list(v)
    lines = [f"trace {report['trace']['digest']}: {report['trace']['requests']} requests, "
             f"outputs agree bit for bit at {report['positions_checked']} (request, layer, position)"]
    lines.append(f"{'':<18}" + "".join(f"{c:>15}" for c in cols))
    for key in ("prefill_tok_s", "decode_tok_s", "requests_s"):
        lines.append(f"{key:<18}" + "".join(f"{v[c][key]:>15.1f}" for c in cols))
    lines.append(f"{'decode step ms':<18}" + "".join(
        f"{'%.2f/%.2f' % (v[c]['decode_step_ms']['median'], v[c]['decode_step_ms']['p95']):>15}" for c in cols))
    for key in ("peak_kv_bytes", "peak_kv_fitted_bytes", "peak_kv_filled_bytes", "peak_live_pages", "kv_bytes_copied", "page_reuses", "tail_waste_slots",
                "leaked_pages", "preemptions"):
        lines.append(f"{key:<18}" + "".join(f"{str(v[c][key]):>15}" for c in cols))
    base = v["dense"]
    lines.append(f"{'paged / dense':<18} decode tok/s x{v['paged']['decode_tok_s'] / base['decode_tok_s']:.2f}, "
                 f"requests/s x{v['paged']['requests_s'] / base['requests_s']:.2f}, "
                 f"peak KV bytes x{v['paged']['peak_kv_bytes'] / base['peak_kv_bytes']:.2f} committed "
                 f"(x{v['paged']['peak_kv_fitted_bytes'] / base['peak_kv_fitted_bytes']:.2f} against fitted dense "
                 f"reservations, x{v['paged']['peak_kv_filled_bytes'] / base['peak_kv_filled_bytes']:.2f} written)")
    lines.append("admission sweep (most requests running at once at a fixed KV budget):")
    for row in report["admission_sweep"]:
        lines.append(f"  {row['budget_tokens']:>7} tokens ({row['budget_bytes'] / 2**20:.0f} MiB): " + ", ".join(
            f"{c} {row[c]['peak_running']}" for c in cols))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small trace that runs in seconds")
    parser.add_argument("--json", metavar="PATH", help="write the report as JSON here")
    args = parser.parse_args(argv)
    report = run(QUICK if args.quick else DEFAULT)
    print(table(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
