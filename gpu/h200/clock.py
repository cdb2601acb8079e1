"""Timing: the median per call (CUDA events after an L2 flush, or perf_counter), CUDA graphs,
and the budget that skips a row which would end past it. T0: the run's start."""

from __future__ import annotations

import math
import statistics
import time

from gpu.h200.rows import Row

T0 = time.monotonic()


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
            return summary(times, "perf_counter")
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
        return summary([s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends)], "cuda events, L2 flushed")

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


def summary(times, method) -> dict:
    times = sorted(times)
    return {"median_s": statistics.median(times), "min_s": times[0],
            "p90_s": times[min(len(times) - 1, int(0.9 * len(times)))], "rounds": len(times), "method": method}


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
