"""Adaptive repetition counts and latency summaries, shared by pytest-benchmark and the report.

One warm-up call is always made and timed; it sets how many timed rounds fit the level's
budget per measurement, within [min, max] rounds:

| level | budget per measurement | rounds    | a 4 s call         | a 30 s call        |
|-------|------------------------|-----------|--------------------|--------------------|
| smoke | -                      | 1         | 1 (pytest: untimed) | 1 (pytest: untimed) |
| quick | 0.6 s                  | 3 .. 600  | warm-up + 2 rounds | warm-up + 1 round  |
| full, long | 1.5 s             | 3 .. 3000 | warm-up + 2 rounds | warm-up + 1 round  |

The cap only stops runaway counts: a 0.1 ms call gets its whole budget (the old cap of
200 rounds timed such a call for 20 ms, so one burst of another job could double its
median). With few rounds p95 is the slowest round (nearest rank). Calls slower than
`SLOW_S` get `min_rounds - 1` rounds, slower than `VERY_SLOW_S` one: their spread is
small next to their length (dense_gather prefill at L 2048 takes ~30 s here).

`side_by_side` times the paths of one case in turns (PASSES passes, each path's rounds
split evenly over them) rather than one path after the other, so a burst of load from
another job lands on every path alike instead of on whichever path was running then.
Each turn starts with untimed calls for at least SETTLE_S (one call at least), so no path
is timed on caches or beside spinning threads left behind by the previous one: torch's
OpenMP workers keep spinning for milliseconds after a call, and an earlier attempt that
alternated paths round by round measured whichever path came next 2-4x slower. The
first pass's turns too: they follow the warm-ups and each other as closely as any
later turn follows its predecessor. When the first pass went unsettled, pagecheck's
decode right after the warm-ups (vLLM's and torch's among them) and `paged`'s first
turn ran 6.6x slower for about 10 ms (B 1 S 128 bf16 on the AMD machine: 0.143 against
0.022 ms; vLLM's op right after pagecheck's calls: unchanged, 0.019 ms), so a quarter
of its rounds sat at the slow time and the quick grid's median read 0.037 ms for a call
that takes 0.022.

`order_check(a, b, rounds)` measures that effect for one pair (the report runs it for
`paged` and `vllm_cpu`, whose idle workers both spin after a call): b's median over a's,
timed interleaved (a, b, a, b, ..., every call timed) and in blocks (a's rounds, then
b's, then b's, then a's, half the rounds each, untimed calls for SETTLE_S ahead of every
block). The two ratios disagree when the larger exceeds the smaller by more than
ORDER_TOLERANCE: then one order charges a kernel for the other's spinning, and the
blocked ratio is the one to trust.
"""

from __future__ import annotations

import math
import statistics
import time

BUDGET_S = {"smoke": 0.0, "quick": 0.6, "full": 1.5, "long": 1.5}
ROUNDS = {"smoke": (1, 1), "quick": (3, 600), "full": (3, 3000), "long": (3, 3000)}
PASSES = {"smoke": 1, "quick": 4, "full": 5, "long": 5}
SETTLE_S = 0.03
SLOW_S = 2.0
VERY_SLOW_S = 10.0
ORDER_TOLERANCE = 0.15  # interleaved vs blocked ratio: more than 15% apart is flagged


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def rounds_for(first_s: float, level: str) -> int:
    """Timed rounds for a call whose warm-up took `first_s` seconds."""
    low, high = ROUNDS[level]
    if first_s > VERY_SLOW_S:
        return 1
    if first_s > SLOW_S:
        return max(1, low - 1)
    return max(low, min(high, math.ceil(BUDGET_S[level] / max(first_s, 1e-9))))


def settle(fn) -> None:
    """Untimed calls until SETTLE_S has passed (at least one)."""
    t0 = time.perf_counter()
    fn()
    while time.perf_counter() - t0 < SETTLE_S:
        fn()


def side_by_side(runs: dict, level: str) -> dict:
    """{name: seconds of each timed round} for zero-argument callables timed in turns.

    Each is warmed up (timed, to size its rounds) first; then PASSES[level] passes give
    every callable its share of rounds, untimed calls for SETTLE_S ahead of each share
    (the first pass's included: module docstring)."""
    rounds = {name: rounds_for(timed(fn), level) for name, fn in runs.items()}
    times = {name: [] for name in runs}
    passes = PASSES[level]
    for i in range(passes):
        for name, fn in runs.items():
            share = rounds[name] * (i + 1) // passes - rounds[name] * i // passes
            if share == 0:
                continue
            if len(runs) > 1:
                settle(fn)
            times[name] += [timed(fn) for _ in range(share)]
    return times


def summary(times) -> dict:
    ordered = sorted(times)
    p95 = ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]
    return {"median_s": statistics.median(ordered), "p95_s": p95, "min_s": ordered[0], "rounds": len(ordered)}


def orders_agree(interleaved_ratio: float, blocked_ratio: float, tolerance: float = ORDER_TOLERANCE) -> bool:
    """Whether the larger ratio is within `tolerance` (relative) of the smaller."""
    low, high = sorted((interleaved_ratio, blocked_ratio))
    return high <= low * (1 + tolerance)


def order_check(a, b, rounds: int) -> dict:
    """b's median / a's median, timed interleaved and in blocks (module docstring)."""
    rounds = max(2, rounds)
    inter_a, inter_b = [], []
    for _ in range(rounds):
        inter_a.append(timed(a))
        inter_b.append(timed(b))
    half = max(1, rounds // 2)
    block_a, block_b = [], []
    for fn, into in ((a, block_a), (b, block_b), (b, block_b), (a, block_a)):
        settle(fn)
        into += [timed(fn) for _ in range(half)]
    interleaved = statistics.median(inter_b) / statistics.median(inter_a)
    blocked = statistics.median(block_b) / statistics.median(block_a)
    return {"interleaved_ratio": interleaved, "blocked_ratio": blocked, "agree": orders_agree(interleaved, blocked),
            "tolerance": ORDER_TOLERANCE, "rounds": rounds,
            "interleaved_median_s": [statistics.median(inter_a), statistics.median(inter_b)],
            "blocked_median_s": [statistics.median(block_a), statistics.median(block_b)]}
