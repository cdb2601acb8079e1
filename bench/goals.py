"""Issue 6's goals and issue 22's, judged from a report's cases (bench/report.py) — never typed by hand.

| goal                                           | measured as                                        | met when |
|------------------------------------------------|----------------------------------------------------|----------|
| decode: paged vs torch SDPA, S >= 1024         | worst torch / paged median over those cases         | >= 1.5x  |
| decode: paged bandwidth fraction, S >= 8192 f32 | worst paged bandwidth_fraction over those cases (against the read limit's stream timed beside each) | >= 70%   |
| prefill: paged vs torch SDPA                   | worst torch / paged median over prefill cases (notes torch cases above the FMA peak) | >= 1x    |
| decode / prefill: paged vs MLX SDPA            | worst mlx_sdpa / paged median (timed cases)         | >= 10x   |
| decode from DRAM: bandwidth fraction          | worst bandwidth_fraction of pagecheck's serving path (SERVING_PATHS) over the decodes whose K/V bytes are at least the read stream's (`read_bytes`: 4x the last-level cache), every dtype and page size; where not met, a profile of the worst (`_dram_profile`: its rate, the stream's and its cached twin's, how much of its arithmetic it hid) | >= 90%   |
| decode: fp8 pages vs bf16 pages, S >= 8192, B >= 4 | worst paged (bf16 pages) / paged_fp8 median, bf16 queries | >= 1.8x |
| decode: fp8 pages bandwidth fraction, S >= 8192, B >= 4 | worst paged_fp8 bandwidth_fraction (bytes actually read: 1-byte codes) | >= 70% |
| write: 1 GiB / 64 MiB pool                     | worst median ratio (1-token append, 128-token chunk) | <= 1.2x  |
| serving: decode tok/s paged / dense            | from the serving trace                              | >= 1.6x  |
| serving: peak KV bytes paged / dense           | from the serving trace                              | <= 0.55x |
| vLLM CPU: pagecheck >= 1.0x on every shape     | worst vllm_cpu / pagecheck median over decode, prefill and mixed cases (the kernel call alone: vLLM's metadata and cache conversion not counted); pagecheck is the serving path a user would run on those pages (SERVING_PATHS): `paged_packed` where it was timed (bf16 pages of 128, the pool's opt-in packed order, as vLLM's AMX path reads its own packed cache), else `paged_now` (decode and mixed, computed in the calling thread as vLLM's op is), else `paged`; where not met, a profile of the worst shape (`_where_the_time_goes`: calls, best calls, where it ran, read rate, FMA share) | >= 1x |
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
DRAM_GOAL = "decode from DRAM: bandwidth fraction"


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
    rival, ours = _timed(cases, op, other), _serving_cases(cases, op)
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


def _serving_cases(cases, op):
    """{shape: case} of pagecheck's serving path on each shape (SERVING_PATHS)."""
    ours = {}
    for path in reversed(SERVING_PATHS):
        ours.update(_timed(cases, op, path))
    return ours


def _from_dram(cases, limits: dict):
    """Issue 22 point 5: [(bandwidth_fraction, case)] of the serving path's decodes that
    read at least as many bytes as the read stream does (4x the last-level cache), so
    their K/V cannot sit in the cache between calls and the fraction compares two reads
    from DRAM. Smaller decodes read above the stream's rate whenever their K/V stays in
    the cache, which says nothing of the memory path."""
    floor = limits.get("read_bytes")
    if floor is None:
        return []
    return [(c["bandwidth_fraction"], c) for c in _serving_cases(cases, "decode").values()
            if "bandwidth_fraction" in c and c["bytes"] >= floor]


def _dram_profile(goal: dict, pairs) -> dict:
    """Where the DRAM goal is not met, where its worst decode's time goes, from the rates
    timed in its turns: the decode's own (X), the read stream's (Y: memory alone) and its
    cached twin's (Z: its loops alone, bench/cached.py). Per byte, memory takes 1/Y and
    the arithmetic 1/Z: one after the other they would read 1 / (1/Y + 1/Z), fully
    overlapped min(Y, Z). The decode hid (1/Y + 1/Z - 1/X) / (1/Z) of its arithmetic
    under the memory's time; the target needs (1/Y + 1/Z - 1/(target Y)) / (1/Z), which
    no overlap gives where Z itself is below target x Y (bound by its arithmetic even
    from cache)."""
    if goal["met"] is not False:
        return goal
    worst = min(pairs, key=lambda pair: pair[0])[1]
    x, y, z = worst["gbytes_per_s"], worst["read_gbytes_per_s"], worst.get("cached_gbytes_per_s")
    text = f"there {worst['path']} read {x:.1f} GB/s against the {y:.1f} GB/s read stream timed beside it"
    if z is None:
        goal["detail"] += f"; {text}; its loops from cache not timed (no cached twin in its turns)"
        return goal
    memory, arithmetic = 1 / y, 1 / z
    hidden = (memory + arithmetic - 1 / x) / arithmetic
    text += (f"; its loops from cache ({worst['cached_case']}, in the same turns) {z:.1f} GB/s: memory and "
             f"arithmetic one after the other would read {1 / (memory + arithmetic):.1f}, fully overlapped "
             f"{min(y, z):.1f}; ")
    text += (f"it hid {hidden:.0%} of its arithmetic under the memory's time" if hidden >= 0 else
             "it ran slower than the two one after the other, hiding none of its arithmetic")
    if z < goal["target"] * y:
        text += f", and its loops alone read below {goal['target']:.0%} of the stream: bound by its arithmetic"
    else:
        needed = (memory + arithmetic - memory / goal["target"]) / arithmetic
        text += f"; {goal['target']:.0%} of the stream needs {needed:.0%} hidden"
    goal["detail"] += "; " + text
    return goal


def _bandwidth_bound(c: dict) -> bool:
    """The issue's bandwidth-bound decode shapes: S >= 8192 and B >= 4."""
    return c["context"] >= 8192 and c["batch"] >= 4


def _call_times(c: dict) -> str:
    """A case's median call, with its best and p95 where the report has them."""
    spread = f" (best {c['min_s'] * 1e3:.3f}, p95 {c['p95_s'] * 1e3:.3f})" if "min_s" in c and "p95_s" in c else ""
    return f"{c['median_s'] * 1e3:.3f} ms{spread}"


def _fma_share(c: dict, limits: dict):
    """gflops over the FMA peak of the kernels' threads: the report's fma_fraction
    (prefill), else derived from the run's limits (decode, mixed)."""
    if "fma_fraction" in c:
        return c["fma_fraction"]
    if "gflops" in c and limits.get("fma_gflops"):
        return c["gflops"] / limits["fma_gflops"]
    return None


def _where_the_time_goes(goal: dict, pairs, cases, limits: dict) -> dict:
    """Where a vLLM goal is not met, a profile of the worst shape, every figure from the
    run's cases and limits:

    | part             | says                                                              |
    |------------------|-------------------------------------------------------------------|
    | calls            | both kernels' median, best and p95 call                           |
    | best calls       | vLLM's best / ours: at or above 1, the medians' gap is the spread of the calls (waits, cache), not the kernel at its best |
    | where it ran     | paged: the MLX stream round trip timed beside it, part of its median; paged_now and paged_packed: in the calling thread, as vLLM's op |
    | read rate        | decode and mixed: both kernels' GB/s against the DRAM stream timed beside them (above it: the K/V came from cache) |
    | FMA peak         | both kernels' share of the FMA peak (above 100%: not float32 multiply-adds) |
    """
    if goal["met"] is not False:
        return goal
    worst = min(pairs, key=lambda p: p[0])[1]
    rival = _timed(cases, worst["op"], "vllm_cpu")[(worst["batch"], worst["context"], worst["page_size"],
                                                     worst["dtype"])]
    parts = [f"there {worst['path']} took {_call_times(worst)}, vllm_cpu {_call_times(rival)}"]
    if "min_s" in worst and "min_s" in rival:
        best = rival["min_s"] / worst["min_s"]
        parts.append(f"best calls {best:.2f}x" + (": the medians' gap is the calls' spread, not the kernel at its best"
                                                   if best >= 1.0 else ", so slower at its best too"))
    if worst["path"] == "paged" and "round_trip_median_s" in worst:
        parts.append(f"{worst['round_trip_median_s'] * 1e3:.3f} ms of paged's median is the MLX stream round trip "
                     "(a trivial op timed beside it; vLLM's op runs in the calling thread)")
    elif worst["path"] != "paged":
        parts.append(f"{worst['path']} runs in the calling thread, as vLLM's op (its checks included)")
    if "gbytes_per_s" in worst and "gbytes_per_s" in rival and "read_gbytes_per_s" in worst:
        read = worst["read_gbytes_per_s"]
        cached = ": both above it, from cache" if min(worst["gbytes_per_s"], rival["gbytes_per_s"]) > read else ""
        parts.append(f"{worst['bytes'] / 1e6:.2f} MB a call at {worst['gbytes_per_s']:.1f} and "
                     f"{rival['gbytes_per_s']:.1f} GB/s against the {read:.1f} GB/s read stream timed beside them"
                     + cached)
    ours_fma, rival_fma = _fma_share(worst, limits), _fma_share(rival, limits)
    if ours_fma is not None and rival_fma is not None:
        parts.append(f"{worst['path']} ran at {ours_fma:.0%} of the FMA peak, vllm_cpu at {rival_fma:.0%}")
    goal["detail"] += "; " + "; ".join(parts)
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
    dram = _from_dram(cases, report.get("limits", {}))
    goals = [
        _goal("decode: paged vs torch SDPA, S >= 1024", _speedup(cases, "decode", "torch_sdpa",
                                                                 lambda c: c["context"] >= 1024), 1.5,
              why_missing=no_torch),
        _goal("decode: paged bandwidth fraction, S >= 8192 f32", bw, 0.70, unit="%"),
        _dram_profile(_by_dtype(_goal(DRAM_GOAL, dram, 0.90, unit="%", why_missing="read limit not measured"), dram),
                      dram),
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
        _where_the_time_goes(_by_dtype(_goal(VLLM_EVERY_GOAL, vllm, 1.0, why_missing=no_vllm), vllm), vllm, cases,
                             report.get("limits", {})),
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
