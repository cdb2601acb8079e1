"""Project-wide pytest set-up: the correctness marker's summary (the main job's
readable report) and the shared recorder of numeric errors."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest

AREAS = {
    "test_oracles": "oracles agree on the hand example and each other",
    "test_differential": "kernel vs the four oracles (tolerance rule)",
    "test_schedules": "decode/prefill schedules, chunk and page edges",
    "test_invariants": "bitwise invariants 2, 6, 7, 8, 9",
    "test_rejections": "bad input: specific error, nothing written",
    "test_runtime": "worker threads, GPU path",
    "test_pool": "page pool: allocation, reference counts, in-place writes",
    "test_cache": "paged cache: append, fork, copy-on-write, release",
    "test_serving_invariants": "serving invariants 1, 3, 4, 5, 10",
    "test_scheduler": "scheduler: admission, preemption, variants agree",
    "test_model": "mlx-lm Qwen3: paged tokens == dense tokens",
}


class ErrorLog:
    """Worst error and worst error/allowance per (dtype, compared-with), for the summary."""

    def __init__(self):
        self.worst = {}

    def record(self, dtype, against: str, verdict) -> None:
        key = (str(dtype).removeprefix("mlx.core."), against)
        err, ratio = self.worst.get(key, (0.0, 0.0))
        share = verdict.error / verdict.allowed if verdict.allowed else float("inf")
        self.worst[key] = (max(err, verdict.error), max(ratio, share))


_LOG = ErrorLog()


@pytest.fixture(scope="session")
def error_log() -> ErrorLog:
    return _LOG


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    # Plain `pytest` runs each benchmark once, untimed, as a smoke test of bench/;
    # `pytest --benchmark-only` (or --benchmark-enable) times them.
    if hasattr(config.option, "benchmark_disable") and not (
            config.option.benchmark_only or config.option.benchmark_enable):
        config.option.benchmark_disable = True


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    counts = collections.defaultdict(collections.Counter)
    for outcome in ("passed", "failed", "skipped", "error"):
        for rep in terminalreporter.stats.get(outcome, []):
            nodeid = getattr(rep, "nodeid", "")
            if not nodeid:
                continue
            module = Path(nodeid.split("::")[0]).stem
            counts[module][outcome] += 1
    if not counts:
        return
    tr = terminalreporter
    tr.section("pagecheck verification summary")
    tr.line(f"{'area':<66} {'passed':>7} {'failed':>7} {'skipped':>8}")
    for module in sorted(counts, key=lambda m: (m not in AREAS, m)):
        c = counts[module]
        label = f"{module}: {AREAS[module]}" if module in AREAS else module
        tr.line(f"{label:<66} {c['passed']:>7} {c['failed'] + c['error']:>7} {c['skipped']:>8}")
    if _LOG.worst:
        tr.line("")
        tr.line("worst max |error| against the float64 oracle (and its share of the allowance)")
        for (dtype, against), (err, share) in sorted(_LOG.worst.items()):
            tr.line(f"  {dtype:<9} {against:<10} {err:.3e}  ({share:.0%} of allowed)")
    verdict = "PASS" if exitstatus == 0 else "FAIL"
    tr.line("")
    tr.line(f"verdict: {verdict}")
