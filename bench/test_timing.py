"""bench/timing.py: round counts from the budget, and paths timed in turns."""

import itertools
import time

import pytest

from bench import timing


def test_rounds_follow_the_budget_not_a_small_cap():
    assert timing.rounds_for(1e-4, "full") == 3000  # 1.5 s / 0.1 ms = 15000: capped
    assert timing.rounds_for(1e-3, "full") == 1500  # the whole budget
    assert timing.rounds_for(1e-3, "quick") == 600
    assert timing.rounds_for(1.0, "full") == 3  # the minimum
    assert timing.rounds_for(3.0, "full") == 2 and timing.rounds_for(30.0, "full") == 1
    assert timing.rounds_for(1e-4, "smoke") == 1


def _fake_paths(monkeypatch, seconds):
    """Paths whose warm-up 'takes' seconds[path]; returns (paths, log of (path, timed?))."""
    log, timing_now = [], [False]

    def fake_timed(fn):
        timing_now[0] = True
        fn()
        timing_now[0] = False
        return seconds[fn.path]

    def make(path):
        def fn():
            log.append((path, timing_now[0]))
        fn.path = path
        return fn

    monkeypatch.setattr(timing, "timed", fake_timed)
    monkeypatch.setattr(timing, "SETTLE_S", 0.0)  # one settle call per turn (see test_settle_*)
    return {p: make(p) for p in seconds}, log


@pytest.mark.parametrize("level", ["quick", "full"])
def test_side_by_side_takes_turns(monkeypatch, level):
    """Each path gets rounds_for(warm-up) timed rounds, split evenly over the passes in
    turns; every turn, the first pass's too, starts with one untimed call."""
    seconds = {"fast": 0.01, "mid": 0.05, "slow": 0.1}  # every path has rounds in every pass
    paths, log = _fake_paths(monkeypatch, seconds)
    times = timing.side_by_side(paths, level)

    want = {p: timing.rounds_for(s, level) for p, s in seconds.items()}
    assert {p: len(t) for p, t in times.items()} == want
    assert log[:3] == [("fast", True), ("mid", True), ("slow", True)], "warm-ups first, each timed"
    turns = [(p, [t for _, t in group]) for p, group in itertools.groupby(log[3:], key=lambda c: c[0])]
    passes = timing.PASSES[level]
    assert [p for p, _ in turns] == ["fast", "mid", "slow"] * passes, "one turn per path per pass, in order"
    for path, calls in turns:
        assert calls.count(False) == 1 and calls[0] is False, f"{path}: not settled first"
    for path, rounds in want.items():
        shares = [calls.count(True) for p, calls in turns if p == path]
        assert sum(shares) == rounds and max(shares) - min(shares) <= 1, f"{path}: uneven split {shares}"


def test_side_by_side_slow_path_runs_once(monkeypatch):
    """A 30 s call: its warm-up and one timed round, with at most one untimed settle call."""
    paths, log = _fake_paths(monkeypatch, {"slow": 30.0, "fast": 0.01})
    times = timing.side_by_side(paths, "full")
    assert len(times["slow"]) == 1 and len(times["fast"]) == timing.rounds_for(0.01, "full")
    slow = [t for p, t in log if p == "slow"]
    assert slow.count(True) == 2 and slow.count(False) <= 1


def test_side_by_side_times_no_round_beside_the_previous_paths_spinning(monkeypatch):
    """Every turn, the first pass's included, starts with an untimed call, so no timed
    round pays for the workers another path left spinning (the penalty lasts one call
    here; timing.settle's calls cover the real one's ~10 ms)."""
    costs = {"spinner": 1e-3, "kernel": 2e-3}
    spinner, kernel = _spinning_clock(monkeypatch, costs, penalty=5e-3)
    times = timing.side_by_side({"spinner": spinner, "kernel": kernel}, "quick")
    for path, cost in costs.items():
        assert times[path] and set(times[path]) == {cost}, f"{path} timed beside the other's spinning workers"


def test_side_by_side_single_path_has_no_settle_calls(monkeypatch):
    calls = []
    monkeypatch.setattr(timing, "timed", lambda fn: (fn(), 0.5)[1])
    times = timing.side_by_side({"only": lambda: calls.append(1)}, "full")
    assert len(times["only"]) == timing.rounds_for(0.5, "full") == 3
    assert len(calls) == 1 + 3


class _Clock:
    """A stand-in for timing's `time` whose clock moves only when a call says so: the
    real one under load let a call start after SETTLE_S (preempted between the check and
    the call), and the test failed with no fault in settle."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


def test_settle_repeats_a_short_call_for_settle_s(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(timing, "time", clock)
    monkeypatch.setattr(timing, "SETTLE_S", 0.02)
    starts = []

    def call():  # a call of 3 ms
        starts.append(clock.now)
        clock.now += 0.003
    timing.settle(call)
    # calls again until SETTLE_S has passed, and none starts after it
    assert starts == pytest.approx([0.003 * i for i in range(7)])


def test_settle_calls_a_long_call_once(monkeypatch):
    monkeypatch.setattr(timing, "SETTLE_S", 0.005)
    calls = []
    timing.settle(lambda: (calls.append(1), time.sleep(0.01)))
    assert len(calls) == 1


def test_orders_agree_within_the_tolerance():
    assert timing.orders_agree(1.0, 1.0 + timing.ORDER_TOLERANCE * 0.99)
    assert timing.orders_agree(1.1, 1.0) and timing.orders_agree(1.0, 1.1)
    assert not timing.orders_agree(2.0, 1.0) and not timing.orders_agree(1.0, 2.0)
    assert timing.orders_agree(1.0, 1.3, tolerance=0.5)


def _spinning_clock(monkeypatch, cost, penalty):
    """A fake `timed`: a call takes cost[path], plus `penalty` when the previous call
    (timed or not) was the other path's: its workers still spinning."""
    last = [None]

    def run(path):
        def fn():
            extra = penalty if last[0] not in (None, path) else 0.0
            last[0] = path
            return cost[path] + extra
        return fn

    monkeypatch.setattr(timing, "timed", lambda fn: fn())
    monkeypatch.setattr(timing, "settle", lambda fn: fn())  # one untimed call
    return tuple(run(path) for path in cost)


def test_order_check_flags_a_kernel_charged_for_the_others_spinning(monkeypatch):
    a, b = _spinning_clock(monkeypatch, {"a": 1.0, "b": 2.0}, penalty=1.0)
    out = timing.order_check(a, b, 10)
    assert out["blocked_ratio"] == 2.0, "in blocks (after an untimed settle call) neither pays the penalty"
    assert out["interleaved_ratio"] == 1.5, "interleaved, b pays it every time and a every time but the first"
    assert out["agree"] is False and out["rounds"] == 10
    assert out["interleaved_median_s"] == [2.0, 3.0] and out["blocked_median_s"] == [1.0, 2.0]


def test_order_check_agrees_without_spinning(monkeypatch):
    a, b = _spinning_clock(monkeypatch, {"a": 1.0, "b": 3.0}, penalty=0.0)
    out = timing.order_check(a, b, 4)
    assert out["interleaved_ratio"] == out["blocked_ratio"] == 3.0 and out["agree"] is True
