"""Project-wide pytest set-up: the correctness marker's summary (the main job's
readable report) and the shared recorder of numeric errors."""

from __future__ import annotations

import collections
import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# --- hypothesis profiles (tests/test_properties.py, tests/test_state_machine.py) ---------
# "ci" (default): fixed examples (derandomize) and no example database, so runs are
# reproducible. "thorough": random and many more examples; each state machine runs
# max_examples x stateful_step_count >= 10^4 steps; tests/test_properties.py runs 4 x
# max_examples per operator property and max_examples per rejection kind.
# Select with `pytest --hypothesis-profile thorough` or HYPOTHESIS_PROFILE=thorough.
# Hypothesis's own files (the thorough example database, its cache of source constants)
# go to the temp dir, not to .hypothesis/ in the checkout.
os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", os.path.join(tempfile.gettempdir(), "pagecheck-hypothesis"))

settings.register_profile("ci", max_examples=30, stateful_step_count=25, deadline=None,
                          derandomize=True, database=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=250, stateful_step_count=50, deadline=None,
                          print_blob=True, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
# --- end of hypothesis profiles -----------------------------------------------------------

AREAS = {
    "test_oracles": "oracles agree on the hand example and each other",
    "test_differential": "kernel vs the four oracles (tolerance rule)",
    "test_schedules": "decode/prefill schedules, chunk and page edges",
    "test_invariants": "operator invariants 1, 2, 3, 6, 7, 8, 9",
    "test_rejections": "bad input: specific error, nothing written",
    "test_runtime": "worker threads, GPU path",
    "test_pool": "page pool: allocation, reference counts, in-place writes",
    "test_cache": "paged cache: append, fork, copy-on-write, release",
    "test_serving_invariants": "serving invariants 1, 3, 4, 5, 10",
    "test_scheduler": "scheduler: admission, preemption, variants agree",
    "test_model": "mlx-lm Qwen3: paged tokens == dense tokens",
    "test_hand_fixtures": "hand fixtures: answers derived by hand",
    "test_golden_bits": "canonical arithmetic: pinned output bits",
    "test_scheduler_invariants": "invariants 1-10 through the scheduler",
    "test_properties": "hypothesis: random layouts vs float64, rejections",
    "test_state_machine": "hypothesis: pool/cache/scheduler state machines",
    "test_edges": "edges: last page, full rows, tails, tiles past a page",
    "test_fuzz_boundary": "fuzzed metadata: specific error or correct result",
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
