"""Stateful test of the scheduler: random sequences of arrivals, steps, aborts and
drains, every invariant of REFERENCE.md section 2 that applies checked after every step.

`SchedulerMachine` drives a `Scheduler` over a `PagedStore` on a small pool (so decodes
preempt) and runs each step's attention with `PagedEngine`, inputs from a tiny `Trace`
(whose rows are the model of what each cache holds). Rules: arrive, step (schedule, run,
complete), abort (then abort a finished or unknown id: refused), drain.

| check (after every step)        | SchedulerMachine                                   |
|---------------------------------|----------------------------------------------------|
| 1 length == positions written   | == request.computed; K/V == trace                  |
| 2 paged == dense attention      | every group's output, in the step rule             |
| 3 ownership                     | `assert_ownership`, no page shared                 |
| 4 no leak, no double free       | `leaked_pages() == 0`, live == union; drain ends with every page free |
| 5 ceil(length / page_size) pages| every running request's cache                      |
| 9 unused slots NaN              | `assert_unused_nan`                                |
| 10 refused call changes nothing | unknown request, id twice, request too big         |

The step rule also checks the scheduler's own contract: admission in arrival order while
the prompt fits beside what running prefills still need, each work starts at the request's
computed positions, a preempted request is younger than every request served in the step
and waits at the front of the queue with nothing held, a position recomputed after a
preemption gets the same output bits (6, 8), a finished request computed prompt + output
positions. No step copies a whole pool layer (`pool_copies`). The pool's machine is in
tests/test_pool_machine.py.

Steps per example and examples come from the hypothesis profile (conftest.py).
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import event, target
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from fixtures import to_numpy
from fixtures.layouts import DTYPES
from fixtures.serving import (Q_HEADS, assert_ownership, assert_paged_equals_dense, assert_pool_stats,
                              assert_same_state, assert_unused_nan, dense_kv, make_pool, pool_state)
from fixtures.trace import Trace
from impl.engine import PagedEngine, step_groups
from impl.errors import ServingError
from impl.pool import pool_copies
from impl.scheduler import Request, Scheduler, State
from impl.stores import PagedStore

pytestmark = [pytest.mark.correctness, pytest.mark.builtin_only("pagecheck's own page pool, cache and scheduler")]


# -- scheduler --------------------------------------------------------------------------------
class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.sched = None
        self.requests: dict[int, Request] = {}
        self.rows: dict[tuple, tuple] = {}      # (rid, layer, position) -> (k, v) float32, the model
        self.outputs: dict[tuple, bytes] = {}   # (rid, layer, position) -> output row bits
        self.rules_since_drain = 0
        self.preemptions = 0

    def teardown(self):
        target(float(self.preemptions), label="preemptions")  # steer generation to crowded pools

    @property
    def pool(self):
        return self.store.pool

    def _kv(self, rid, layer, pos) -> tuple[np.ndarray, np.ndarray]:
        key = (rid, layer, pos)
        if key not in self.rows:
            t = self.trace
            r = t.rows(rid, layer, pos, 1)[0]
            Hq, Hkv, D = t.q_heads, t.kv_heads, t.head_dim
            k = r[Hq * D:(Hq + Hkv) * D].reshape(Hkv, D)
            v = r[(Hq + Hkv) * D:].reshape(Hkv, D)
            self.rows[key] = tuple(to_numpy(mx.array(x).astype(t.mx_dtype)) for x in (k, v))
        return self.rows[key]

    def _check_cache(self, rid, length) -> None:
        """Invariant 1: the cache holds `length` positions, each the trace's K/V row."""
        c = self.store.caches[rid]
        assert c.length == length, f"request {rid}: cache length {c.length}, expected {length}"
        for layer in range(self.pool.num_layers):
            k, v = dense_kv(c, layer)
            if length:
                want = [self._kv(rid, layer, p) for p in range(length)]
                assert np.array_equal(k, np.stack([w[0] for w in want])), f"request {rid} layer {layer}: keys"
                assert np.array_equal(v, np.stack([w[1] for w in want])), f"request {rid} layer {layer}: values"

    def _snapshot(self):
        s = self.sched
        return ([r.rid for r in s.waiting], [r.rid for r in s.running], [r.rid for r in s.done],
                pool_state(self.pool, *self.store.caches.values()))

    def _refused(self, call, clause) -> None:
        before = self._snapshot()
        with pytest.raises(ServingError) as info:
            call()
        assert type(info.value) is ServingError and info.value.clause == clause, info.value
        after = self._snapshot()
        assert before[:3] == after[:3]
        assert_same_state(before[3], after[3])

    # -- rules ------------------------------------------------------------------------------
    @initialize(page_size=st.integers(1, 4), num_pages=st.integers(3, 8), max_batch=st.integers(1, 4),
                prefill_step=st.integers(1, 8), dtype=st.sampled_from(sorted(DTYPES)), seed=st.integers(0, 3))
    def start(self, page_size, num_pages, max_batch, prefill_step, dtype, seed):
        self.trace = Trace(seed=seed, layers=2, q_heads=Q_HEADS, kv_heads=2, head_dim=8, dtype=dtype,
                           page_size=page_size, batch=max_batch, prefill_step=prefill_step)
        pool = make_pool(page_size=page_size, num_pages=num_pages, dtype=DTYPES[dtype], poison_freed=True)
        self.store = PagedStore(pool)
        self.sched = Scheduler(self.store, max_batch=max_batch, prefill_step=prefill_step)
        self.engine = PagedEngine(self.store)
        self.copies = pool_copies()

    @precondition(lambda self: self.sched is not None and len(self.sched.waiting) < 3)
    @rule(count=st.integers(1, 3), data=st.data())
    def arrive(self, count, data):
        """One to three requests arrive, each up to half the pool (so a few together preempt);
        one now and then too big to ever fit, refused with nothing changed."""
        self.rules_since_drain += 1
        half = max(1, self.pool.num_pages * self.pool.page_size // 2)
        for _ in range(count):
            prompt = data.draw(st.integers(1, half), label="prompt_len")
            max_new = data.draw(st.integers(0, half), label="max_new_tokens")
            if data.draw(st.integers(0, 9), label="oversized") == 9:
                max_new = self.pool.num_pages * self.pool.page_size - prompt + 1
            output = data.draw(st.one_of(st.just(max_new), st.integers(0, max_new)), label="output_len")
            req = Request(len(self.requests), prompt, max_new, output)
            if self.store.pages_for(prompt + max_new) > self.pool.num_pages:
                self._refused(lambda: self.sched.add(req), "capacity")
                continue
            self.sched.add(req)
            self.requests[req.rid] = req
            self._refused(lambda: self.sched.add(Request(req.rid, 1, 0)), "request")  # an id given twice

    def _run_step(self, oracle: bool = True) -> None:
        sched, store = self.sched, self.store
        age = [r.rid for r in sched.running] + [r.rid for r in sched.waiting]  # admission order
        free, waiting, running = self.pool.stats().free, list(sched.waiting), len(sched.running)
        pending = sum(store.pages_for(r.prefill_target) - len(store.caches[r.rid].pages)
                      for r in sched.running if r.in_prefill)
        step = sched.schedule()
        # memory-capped admission in arrival order: each admitted prompt fits beside what
        # running prefills still need; the first one left waiting would not have
        admitted = [r for r in waiting if r.state is State.RUNNING or r in step.preempted]
        assert admitted == waiting[:len(admitted)], "admission skipped ahead in the queue"
        for r in admitted:
            pending += store.pages_for(r.prefill_target)
            assert pending <= free, f"request {r.rid} admitted without room for its prompt"
        rest = waiting[len(admitted):]
        if rest and running + len(admitted) < sched.max_batch:
            assert pending + store.pages_for(rest[0].prefill_target) > free, f"request {rest[0].rid} not admitted"
        for r in step.preempted:
            assert (r.state, r.computed) == (State.WAITING, 0) and r.rid not in self.store.caches
            event("preempted")
            self.preemptions += 1
        victims = [r.rid for r in step.preempted]
        assert {r.rid for r in list(sched.waiting)[:len(victims)]} == set(victims), "victims go to the front"
        for w in step.works:   # the youngest request not served this step is the one preempted
            assert all(age.index(v) > age.index(w.request.rid) for v in victims), \
                f"preempted {victims} but served the younger request {w.request.rid}"
        for w in step.works:
            r = w.request
            assert r.state is State.RUNNING and w.start == r.computed
            assert self.store.caches[r.rid].length == w.start + w.count  # reserved, not yet written
            assert w.count == 1 if w.decode else 1 <= w.count <= sched.prefill_step
        assert len(sched.running) <= sched.max_batch
        for group in step_groups(step):
            inputs = self.trace.group_inputs(group)
            outs = self.engine.run_group(group, inputs)
            mx.eval(outs)
            self._check_group(group, inputs, outs, oracle)
        finished = sched.complete(step)
        for r in finished:
            assert r.state is State.FINISHED and r.computed == r.prompt_len + r.output_len
            assert r.generated == r.output_len and r.rid not in self.store.caches

    def _check_group(self, group, inputs, outs, oracle: bool) -> None:
        for w in group:
            self._check_cache(w.request.rid, w.start + w.count)
        for layer, ((q, _, _), out) in enumerate(zip(inputs, outs)):
            dense = [dense_kv(self.store.caches[w.request.rid], layer) for w in group]
            if oracle:
                assert_paged_equals_dense(q, dense, out)
            for b, w in enumerate(group):
                for l in range(w.count):
                    key = (w.request.rid, layer, w.start + l)
                    row = np.array(out[b, :, l].astype(mx.float32)).tobytes()
                    # a position recomputed after a preemption gives the same bits (6, 8)
                    assert self.outputs.setdefault(key, row) == row, f"recomputed {key} differs"

    @rule()
    def step(self):
        """One scheduler step (an empty one when there is no work)."""
        self.rules_since_drain += 1
        self._run_step()

    @rule(data=st.data())
    def abort(self, data):
        """Aborts a waiting or running request (its pages come back); then aborting it again,
        an id never given and a negative one are refused with nothing changed."""
        self.rules_since_drain += 1
        live = sorted(r.rid for r in [*self.sched.waiting, *self.sched.running])
        if live and data.draw(st.integers(0, 2), label="abort a live request (0: no)"):
            rid = data.draw(st.sampled_from(live), label="rid")
            held = self.store.caches[rid].pages if rid in self.store.caches else []
            free = self.pool.stats().free
            req = self.sched.abort(rid)
            assert req.state is State.ABORTED and rid not in self.store.caches
            assert self.pool.stats().free == free + len(held)
        done = [r.rid for r in self.sched.done]
        for unknown in done[-1:] + [len(self.requests), -1]:
            self._refused(lambda: self.sched.abort(unknown), "request")

    @precondition(lambda self: self.sched is not None and self.sched.has_work and self.rules_since_drain >= 12)
    @rule()
    def drain(self):
        """Runs every request to its end: all finish, every page comes back. (The steps
        check everything but the oracle, which the step rule checks.)"""
        self.rules_since_drain = 0
        work = sum(r.prompt_len + r.output_len for r in [*self.sched.waiting, *self.sched.running])
        for _ in range(4 * work * (1 + len(self.sched.waiting) + len(self.sched.running))):
            if not self.sched.has_work:
                break
            self._run_step(oracle=False)
        assert not self.sched.has_work, "the scheduler made no progress (livelock)"
        s = self.pool.stats()
        assert (s.live, s.free, self.store.caches) == (0, self.pool.num_pages, {})

    # -- invariants -------------------------------------------------------------------------
    @invariant()
    def inv1_length_is_computed(self):
        s = self.sched
        for r in s.running:
            assert r.state is State.RUNNING and r.computed <= r.prefill_target
            self._check_cache(r.rid, r.computed)
        for r in s.waiting:
            assert r.state is State.WAITING and r.computed == 0 and r.rid not in self.store.caches
        for r in s.done:
            assert r.state in (State.FINISHED, State.ABORTED) and r.rid not in self.store.caches
        ids = [r.rid for r in [*s.waiting, *s.running, *s.done]]
        assert sorted(ids) == sorted(self.requests), "a request is lost or in two queues"
        assert len(s.running) <= s.max_batch
        assert [r.admitted for r in s.running] == sorted(r.admitted for r in s.running)

    @invariant()
    def inv3_ownership(self):
        caches = list(self.store.caches.values())
        assert_ownership(self.pool, *caches)
        assert all(self.pool.ref_count(p) == 1 for c in caches for p in c.pages), "the scheduler never shares"

    @invariant()
    def inv4_no_leak_no_double_free(self):
        assert self.store.leaked_pages() == 0
        assert_pool_stats(self.pool, self.store.caches.values())
        assert pool_copies() == self.copies, "a pool update copied a whole layer"

    @invariant()
    def inv5_pages_follow_length(self):
        for c in self.store.caches.values():
            assert len(c.pages) == math.ceil(c.length / self.pool.page_size)

    @invariant()
    def inv9_unused_slots_are_nan(self):
        assert_unused_nan(self.pool, *self.store.caches.values())


TestSchedulerMachine = SchedulerMachine.TestCase
