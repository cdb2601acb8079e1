"""Adaptive repetition counts and latency summaries, shared by pytest-benchmark and the report.

One warm-up call is always made and timed; it sets how many timed rounds fit the level's
budget per measurement, within [min, max] rounds:

| level | budget per measurement | rounds   | a 4 s call         | a 30 s call        |
|-------|------------------------|----------|--------------------|--------------------|
| smoke | -                      | 1        | 1 (pytest: untimed) | 1 (pytest: untimed) |
| quick | 0.6 s                  | 3 .. 60  | warm-up + 2 rounds | warm-up + 1 round  |
| full  | 1.5 s                  | 3 .. 200 | warm-up + 2 rounds | warm-up + 1 round  |

With few rounds p95 is the slowest round (nearest rank). Calls slower than `SLOW_S`
get `min_rounds - 1` rounds, slower than `VERY_SLOW_S` one: their spread is small next
to their length (dense_gather prefill at L 2048 takes ~30 s here).
"""

from __future__ import annotations

import math
import statistics
import time

BUDGET_S = {"smoke": 0.0, "quick": 0.6, "full": 1.5}
ROUNDS = {"smoke": (1, 1), "quick": (3, 60), "full": (3, 200)}
SLOW_S = 2.0
VERY_SLOW_S = 10.0


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


def measure(fn, level: str) -> list[float]:
    """Warm-up once, then the adaptive number of timed rounds; returns their seconds."""
    first = timed(fn)
    return [timed(fn) for _ in range(rounds_for(first, level))]


def summary(times) -> dict:
    ordered = sorted(times)
    p95 = ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]
    return {"median_s": statistics.median(ordered), "p95_s": p95, "min_s": ordered[0], "rounds": len(ordered)}
