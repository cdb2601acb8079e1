"""Issue 6's goals, judged from a report's cases (bench/report.py) — never typed by hand.

| goal                                           | measured as                                        | met when |
|------------------------------------------------|----------------------------------------------------|----------|
| decode: paged vs torch SDPA, S >= 1024         | worst torch / paged median over those cases         | >= 1.5x  |
| decode: paged bandwidth fraction, S >= 8192 f32 | worst paged bandwidth_fraction over those cases (against the read limit's stream timed beside each) | >= 70%   |
| prefill: paged vs torch SDPA                   | worst torch / paged median over prefill cases (notes torch cases above the FMA peak) | >= 1x    |
| decode / prefill: paged vs MLX SDPA            | worst mlx_sdpa / paged median (timed cases)         | >= 10x   |
| decode: fp8 pages vs bf16 pages, S >= 8192, B >= 4 | worst paged (bf16 pages) / paged_fp8 median, bf16 queries | >= 1.8x |
| decode: fp8 pages bandwidth fraction, S >= 8192, B >= 4 | worst paged_fp8 bandwidth_fraction (bytes actually read: 1-byte codes) | >= 70% |
| write: 1 GiB / 64 MiB pool                     | worst median ratio (1-token append, 128-token chunk) | <= 1.2x  |
| serving: decode tok/s paged / dense            | from the serving trace                              | >= 1.6x  |
| serving: peak KV bytes paged / dense           | from the serving trace                              | <= 0.55x |
| vLLM CPU: pagecheck >= 1.0x on every shape     | worst vllm_cpu / pagecheck median over decode, prefill and mixed cases (the kernel call alone: vLLM's metadata and cache conversion not counted); pagecheck is the serving path a user would run on those pages (SERVING_PATHS): `paged_packed` where it was timed (bf16 pages of 128, the pool's opt-in packed order, as vLLM's AMX path reads its own packed cache), else `paged_now` (decode and mixed, computed in the calling thread as vLLM's op is), else `paged`; where not met, where the time goes at the worst shape | >= 1x |
| vLLM CPU: pagecheck median speed-up            | median vllm_cpu / pagecheck over the same cases      | >= 1.5x  |
| latency: paged_attention overhead, B1 S1024 ps16 f32 | paged_attention median - paged_attention_with_metadata median, timed interleaved (bench/overhead.py) | <= 20 us |

"Worst" is the strict reading: a goal is met only where every case meets it. Each goal
also carries the median over its cases and the worst case's name.
"""

from __future__ import annotations

import statistics

OVERHEAD_GOAL = "latency: paged_attention overhead, B1 S1024 ps16 f32"
VLLM_EVERY_GOAL = "vLLM CPU: pagecheck >= 1.0x on every shape"
VLLM_MEDIAN_GOAL = "vLLM CPU: pagecheck median speed-up"


def _name(c: dict) -> str:
    return f"B{c['batch']} S{c['context']} ps{c['page_size']} {c['dtype']}"


def _timed(cases, op, path):
    return {(c["batch"], c["context"], c["page_size"], c["dtype"]): c for c in cases
            if c["op"] == op and c["path"] == path and "median_s" in c}


def _speedup(cases, op, other, keep=lambda c: True):
    """[(other median / paged median, paged case)] over cases where both were timed."""
    paged, rival = _timed(cases, op, "paged"), _timed(cases, op, other)
    return [(rival[k]["median_s"] / paged[k]["median_s"], paged[k]) for k in paged if k in rival and keep(paged[k])]


# pagecheck's serving path on a shape, the first of these timed there (bench/grid.py):
# packed pages where they hold the spec (bf16, pages of a multiple of 32), else the row
# pages computed now (decode, mixed), else the lazy call (prefill). Both packed and now
# run in the calling thread, as vLLM's op does.
SERVING_PATHS = ("paged_packed", "paged_now", "paged")


def _serving_speedup(cases, op, other):
    """_speedup against pagecheck's serving path on each shape (SERVING_PATHS)."""
    rival, ours = _timed(cases, op, other), {}
    for path in reversed(SERVING_PATHS):
        ours.update(_timed(cases, op, path))
    return [(rival[k]["median_s"] / ours[k]["median_s"], ours[k]) for k in ours if k in rival]


def _goal(name, pairs, target, *, at_least=True, unit="x", why_missing="not measured"):
    if not pairs:
        return {"goal": name, "target": target, "at_least": at_least, "unit": unit, "measured": None,
                "met": None, "detail": why_missing}
    worst_value, worst_case = (min if at_least else max)(pairs, key=lambda p: p[0])
    met = worst_value >= target if at_least else worst_value <= target
    detail = f"worst {_name(worst_case)}" if "batch" in worst_case else worst_case.get("name", "")
    if len(pairs) > 1:
        detail += f"; median {_fmt(statistics.median(p[0] for p in pairs), unit)} over {len(pairs)} cases"
    return {"goal": name, "target": target, "at_least": at_least, "unit": unit, "measured": worst_value,
            "met": met, "detail": detail}


def _by_dtype(goal: dict, pairs) -> dict:
    """Adds the worst value per dtype when the goal spans more than one."""
    worst = {}
    for value, case in pairs:
        dt = case["dtype"]
        worst[dt] = min(worst.get(dt, value), value) if goal["at_least"] else max(worst.get(dt, value), value)
    if len(worst) > 1:
        goal["detail"] += "; worst per dtype: " + ", ".join(f"{dt} {_fmt(v, goal['unit'])}" for dt, v in worst.items())
    return goal


def _beyond_fma(goal: dict, cases) -> dict:
    """Notes the prefill cases where torch runs faster than any float32 FMA kernel can
    on this machine (its fma_fraction above 1: bf16 on AMX tiles), which no kernel
    keeping float32 multiply-adds can match however it is tuned."""
    over = [c for c in cases if c["op"] == "prefill" and c["path"] == "torch_sdpa" and c.get("fma_fraction", 0) > 1]
    if over:
        worst = max(over, key=lambda c: c["fma_fraction"])
        goal["detail"] += (f"; torch_sdpa runs above this machine's float32 FMA peak in {len(over)} case(s) "
                           f"(up to {worst['fma_fraction']:.2f}x the peak, {_name(worst)})")
    return goal


def _pages_speedup(cases, path, keep):
    """[(paged median / `path` median, path's case)]: how much faster the same decode runs
    on `path`'s quantized pages than on the spec's own (bench/grid.py KV_PATHS)."""
    paged, quantized = _timed(cases, "decode", "paged"), _timed(cases, "decode", path)
    return [(paged[k]["median_s"] / quantized[k]["median_s"], quantized[k]) for k in quantized
            if k in paged and keep(quantized[k])]


def _bandwidth_bound(c: dict) -> bool:
    """The issue's bandwidth-bound decode shapes: S >= 8192 and B >= 4."""
    return c["context"] >= 8192 and c["batch"] >= 4


def _where_the_time_goes(goal: dict, pairs, cases) -> dict:
    """Where a vLLM goal is not met, what paged's time at the worst shape holds: the MLX
    stream round trip timed beside it (a decode or mixed case: every call through MLX
    waits on its stream thread, while vLLM's op runs in the calling thread), or the share
    of the FMA peak each kernel reached (prefill)."""
    if goal["met"] is not False:
        return goal
    worst = min(pairs, key=lambda p: p[0])[1]
    key = (worst["batch"], worst["context"], worst["page_size"], worst["dtype"])
    if worst["path"] != "paged" and worst["op"] != "prefill":
        rival = _timed(cases, worst["op"], "vllm_cpu")[key]
        goal["detail"] += (f"; there {worst['path']} took {worst['median_s'] * 1e3:.3f} ms in the calling thread "
                           f"(no stream round trip; the call's checks included), vllm_cpu "
                           f"{rival['median_s'] * 1e3:.3f} ms")
    elif "round_trip_median_s" in worst:
        goal["detail"] += (f"; there {worst['path']} took {worst['median_s'] * 1e3:.3f} ms, of it "
                           f"{worst['round_trip_median_s'] * 1e3:.3f} ms the MLX stream round trip (a trivial op "
                           "timed beside it; vLLM's op runs in the calling thread)")
    elif "fma_fraction" in worst:
        rival = _timed(cases, worst["op"], "vllm_cpu")[key]
        goal["detail"] += (f"; there {worst['path']} ran at {worst['fma_fraction']:.0%} of the FMA peak, vllm_cpu at "
                           f"{rival['fma_fraction']:.0%}")
    return goal


def _fmt(value, unit) -> str:
    if unit == "us":
        return f"{value * 1e6:.1f} us"
    return f"{value:.0%}" if unit == "%" else f"{value:.2f}x"


def evaluate(report: dict) -> list[dict]:
    cases = report["cases"]
    no_torch = "torch_sdpa not timed (" + next(
        (c["skipped"] for c in cases if c["path"] == "torch_sdpa" and "skipped" in c), "no cases") + ")"
    bw = [(c["bandwidth_fraction"], c) for c in _timed(cases, "decode", "paged").values()
          if c["context"] >= 8192 and c["dtype"] == "float32"]
    writes = [(c["ratio_vs_smallest_pool"], {"name": f"{c['tokens']}-token write, {c['pool_mib']} MiB pool"})
              for c in cases if c["op"] == "write" and c["pool_mib"] != min(w["pool_mib"] for w in cases
                                                                         if w["op"] == "write")]
    prefill_torch = _speedup(cases, "prefill", "torch_sdpa")
    goals = [
        _goal("decode: paged vs torch SDPA, S >= 1024", _speedup(cases, "decode", "torch_sdpa",
                                                                 lambda c: c["context"] >= 1024), 1.5,
              why_missing=no_torch),
        _goal("decode: paged bandwidth fraction, S >= 8192 f32", bw, 0.70, unit="%"),
        _beyond_fma(_by_dtype(_goal("prefill: paged vs torch SDPA", prefill_torch, 1.0, why_missing=no_torch),
                              prefill_torch), cases),
        _goal("decode: paged vs MLX SDPA", _speedup(cases, "decode", "mlx_sdpa"), 10.0),
        _goal("prefill: paged vs MLX SDPA", _speedup(cases, "prefill", "mlx_sdpa"), 10.0),
        _goal("decode: fp8 pages vs bf16 pages, S >= 8192, B >= 4",
              _pages_speedup(cases, "paged_fp8", lambda c: _bandwidth_bound(c) and c["dtype"] == "bfloat16"), 1.8),
        _goal("decode: fp8 pages bandwidth fraction, S >= 8192, B >= 4",
              [(c["bandwidth_fraction"], c) for c in _timed(cases, "decode", "paged_fp8").values()
               if _bandwidth_bound(c)], 0.70, unit="%"),
        _goal("write: 1 GiB / 64 MiB pool, same write", writes, 1.2, at_least=False),
    ]
    no_vllm = "vllm_cpu not timed (" + next(
        (c["skipped"] for c in cases if c["path"] == "vllm_cpu" and "skipped" in c), "no cases") + ")"
    vllm = [pair for op in ("decode", "prefill", "mixed") for pair in _serving_speedup(cases, op, "vllm_cpu")]
    median = [(statistics.median(v for v, _ in vllm), {"name": f"median over {len(vllm)} shapes"})] if vllm else []
    goals += [
        _where_the_time_goes(_by_dtype(_goal(VLLM_EVERY_GOAL, vllm, 1.0, why_missing=no_vllm), vllm), vllm, cases),
        _goal(VLLM_MEDIAN_GOAL, median, 1.5, why_missing=no_vllm),
    ]
    serving = report.get("serving")
    ratios = serving["ratios"] if serving else None
    goals += [
        _goal("serving: decode tok/s paged / dense",
              [(ratios["decode_tok_s"], {"name": serving["trace_name"]})] if ratios else [], 1.6,
              why_missing="serving trace not run"),
        _goal("serving: peak KV bytes paged / dense",
              [(ratios["peak_kv_bytes"], {"name": serving["trace_name"]})] if ratios else [], 0.55,
              at_least=False, why_missing="serving trace not run"),
    ]
    overhead = [(r["overhead_s"], r) for r in report.get("overhead", [])
                if (r["batch"], r["context"], r["page_size"], r["dtype"]) == (1, 1024, 16, "float32")]
    goals.append(_goal(OVERHEAD_GOAL, overhead, 20e-6, at_least=False, unit="us",
                       why_missing="overhead not measured"))
    return goals


def verdict(goal: dict) -> str:
    return {True: "met", False: "not met", None: "n/a"}[goal["met"]]


def describe(goal: dict) -> tuple[str, str]:
    """(measured, target) as text."""
    sign = ">=" if goal["at_least"] else "<="
    measured = "-" if goal["measured"] is None else _fmt(goal["measured"], goal["unit"])
    return measured, f"{sign} {_fmt(goal['target'], goal['unit'])}"
