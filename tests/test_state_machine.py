"""Stateful tests of the serving core: random sequences of operations, every invariant
of REFERENCE.md section 2 that applies checked after every step.

`PoolMachine` drives one `PagePool` (poison_freed, NaN fill) and several `PagedCache`s
directly and keeps a shadow model: the rows written into each cache, per layer.
Rules: new cache, append, fork, write into a shared tail page (copy-on-write), release,
release again / use after release, free a page twice, exhaust the pool.

`SchedulerMachine` drives a `Scheduler` over a `PagedStore` on a small pool (so decodes
preempt) and runs each step's attention with `PagedEngine`, inputs from a tiny `Trace`
(whose rows are the model of what each cache holds). Rules: arrive, step (schedule, run,
complete), abort (then abort a finished or unknown id: refused), drain.

| check (after every step)        | PoolMachine                           | SchedulerMachine                  |
|---------------------------------|---------------------------------------|-----------------------------------|
| 1 length == positions written   | == shadow rows; K/V bits == shadow    | == request.computed; K/V == trace |
| 2 paged == dense attention      | kernel over all caches vs float64 oracle on `dense_kv` | every group's output, in the step rule |
| 3 ownership                     | `assert_ownership`                    | `assert_ownership`, no page shared |
| 4 no leak, no double free       | stats == model's allocations/frees/copies, live == union of holders | `leaked_pages() == 0`, live == union; drain ends with every page free |
| 5 ceil(length / page_size) pages| every live cache                      | every running request's cache      |
| 9 unused slots NaN              | `assert_unused_nan`                   | `assert_unused_nan`               |
| 10 refused call changes nothing | exhausted pool, max_tokens, double release, double free | unknown request, id twice, request too big |

The scheduler's step rule also checks its own contract: admission in arrival order while
the prompt fits beside what running prefills still need, each work starts at the request's
computed positions, a preempted request is younger than every request served in the step
and waits at the front of the queue with nothing held, a position recomputed after a
preemption gets the same output bits (6, 8), a finished request computed prompt + output
positions. No step copies a whole pool layer (`pool_copies`).

Steps per example and examples come from the hypothesis profile (conftest.py).
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import event, target
from hypothesis import strategies as st
from hypothesis.stateful import (Bundle, RuleBasedStateMachine, consumes, initialize, invariant, multiple, precondition,
                                 rule)

import impl
import oracles
from fixtures import to_numpy
from fixtures.layouts import DTYPES
from fixtures.serving import (assert_ownership, assert_same_state, assert_unused_nan, dense_kv, dense_layout,
                              fill_cache, make_pool, pool_state)
from fixtures.trace import Trace
from impl.cache import PagedCache
from impl.engine import PagedEngine, step_groups
from impl.errors import PageAlreadyFree, PoolExhausted, ServingError
from impl.pool import pool_copies
from impl.scheduler import Request, Scheduler, State
from impl.stores import PagedStore
from oracles.compare import value_scale
from oracles.tolerance import Verdict, allowed_error, max_abs_error

pytestmark = [pytest.mark.correctness, pytest.mark.builtin_only("pagecheck's own page pool, cache and scheduler")]

Q_HEADS = 4  # the pools of fixtures.serving.make_pool have 2 KV heads, D = 8, 2 layers
ATTENTION = (("causal", None), (None, None), ("causal", 2))


def _check_attention(q, dense, out, mask="causal", window=None) -> None:
    """Invariant 2: `out` (paged) against the float64 oracle on the dense K/V, tolerance rule."""
    args = (q, *dense_layout(dense, q.dtype))
    kwargs = {"scale": None, "mask": mask, "window": window}
    ref = oracles.float64(*args, **kwargs)
    sdpa = oracles.MLX_ORACLES["sdpa"](*args, **kwargs)
    verdict = Verdict(max_abs_error(out, ref), allowed_error(q.dtype, ref, max_abs_error(sdpa, ref),
                                                             value_scale(args[2])))
    assert verdict.ok, f"paged attention != attention on the dense K/V: {verdict}"


def _check_stats(pool, holders) -> None:
    """Invariant 4's bookkeeping: live pages are exactly the union of the holders' pages."""
    s = pool.stats()
    held = set().union(*(c.pages for c in holders))
    live = {p for p in range(pool.num_pages) if pool.ref_count(p)}
    assert live == held, f"live pages {sorted(live)} but holders hold {sorted(held)}"
    assert s.live == len(live) == s.allocations - s.frees, s
    assert s.free == pool.num_pages - s.live and s.peak_live >= s.live, s


# -- pool + caches ----------------------------------------------------------------------------
class Handle:
    """A cache of the machine, named for the printed steps."""

    def __init__(self, n: int):
        self.n = n

    def __repr__(self) -> str:
        return f"cache{self.n}"


class PoolMachine(RuleBasedStateMachine):
    caches = Bundle("caches")
    released = Bundle("released")

    def __init__(self):
        super().__init__()
        self.pool = None
        self.live: dict[Handle, PagedCache] = {}
        self.gone: dict[Handle, PagedCache] = {}
        self.shadow: dict[Handle, list] = {}   # per layer [key chunks, value chunks], float32
        self.expect = {"allocations": 0, "frees": 0, "pages_copied": 0}
        self.seed = self.checks = 0

    # -- helpers ----------------------------------------------------------------------------
    def _add(self, cache, shadow=None) -> Handle:
        h = Handle(len(self.live) + len(self.gone))
        self.live[h] = cache
        self.shadow[h] = shadow or [[[], []] for _ in range(self.pool.num_layers)]
        return h

    def _state(self):
        return pool_state(self.pool, *self.live.values(), *self.gone.values())

    def _need(self, c, n) -> tuple[int, bool]:
        """The model's count of pages appending n rows to c takes: new tail pages, plus one
        when the tail page is partial and shared (copy-on-write)."""
        ps = self.pool.page_size
        cow = n > 0 and c.length % ps != 0 and self.pool.ref_count(c.pages[-1]) > 1
        return max(-(-(c.length + n) // ps) - len(c.pages), 0) + cow, cow

    def _write(self, h, n) -> None:
        """Appends n rows to cache h (the caller checked they fit), updates the model."""
        c, pool = self.live[h], self.pool
        (need, cow), old, length = self._need(c, n), list(c.pages), c.length
        allocations = pool.stats().allocations
        self.seed += 1
        ks, vs = fill_cache(c, n, seed=self.seed)
        for layer in range(pool.num_layers):
            self.shadow[h][layer][0].append(ks[layer])
            self.shadow[h][layer][1].append(vs[layer])
        # invariant 5: a new page only when the tail is full (plus the copy of a shared tail)
        assert c.length == length + n
        assert pool.stats().allocations - allocations == need == len(c.pages) - len(old) + cow
        kept = len(old) - cow
        assert c.pages[:kept] == old[:kept], "pages already held moved"
        if cow:
            assert c.pages[kept] != old[kept] and pool.ref_count(c.pages[kept]) == 1
            event("copy-on-write")
        self.expect["allocations"] += need
        self.expect["pages_copied"] += cow

    def _refused(self, call, error, clause) -> None:
        """Invariant 10: a refused call raises `error` and changes no bit of pool or caches."""
        before, copies = self._state(), pool_copies()
        with pytest.raises(error) as info:
            call()
        assert type(info.value) is error and info.value.clause == clause, info.value
        assert_same_state(before, self._state())
        assert pool_copies() == copies

    # -- rules ------------------------------------------------------------------------------
    @initialize(target=caches, page_size=st.integers(1, 5), num_pages=st.integers(2, 16),
                dtype=st.sampled_from(sorted(DTYPES)))
    def start(self, page_size, num_pages, dtype):
        self.pool = make_pool(page_size=page_size, num_pages=num_pages, dtype=DTYPES[dtype], poison_freed=True)
        self.copies = pool_copies()
        return self._add(PagedCache(self.pool))

    @rule(target=caches, max_tokens=st.one_of(st.none(), st.integers(0, 16)), n=st.integers(0, 9))
    def new_cache(self, max_tokens, n):
        """A new cache, its first n positions written when they fit."""
        h = self._add(PagedCache(self.pool, max_tokens=max_tokens))
        if (max_tokens is None or n <= max_tokens) and self._need(self.live[h], n)[0] <= self.pool.stats().free:
            self._write(h, n)
        return h

    @rule(h=caches, n=st.integers(0, 9))
    def append(self, h, n):
        c = self.live[h]
        if c.max_tokens is not None and c.length + n > c.max_tokens:
            self._refused(lambda: fill_cache(c, n), ServingError, "capacity")
        elif self._need(c, n)[0] > self.pool.stats().free:
            self._refused(lambda: fill_cache(c, n), PoolExhausted, "pool_exhausted")
        else:
            self._write(h, n)

    @rule(target=caches, h=caches)
    def fork(self, h):
        child = self.live[h].fork()
        return self._add(child, [[list(k), list(v)] for k, v in self.shadow[h]])

    def _room(self, c) -> int:
        return c.max_tokens - c.length if c.max_tokens is not None else 1 << 30

    @rule(target=caches, h=caches, data=st.data())
    def write_shared(self, h, data):
        """Copy-on-write. h's tail page is made partial (a few rows) and shared (a fork)
        when it is not yet; then rows go into it: the writer gets a private copy of the
        page, every other holder keeps the old page and its bits."""
        c, pool = self.live[h], self.pool
        ps, child = pool.page_size, multiple()
        if ps == 1:
            return child                                # a page of one slot is never partial
        if c.length % ps == 0:
            n = data.draw(st.integers(1, ps - 1), label="rows to make the tail partial")
            if n > self._room(c) or self._need(c, n)[0] > pool.stats().free:
                return child
            self._write(h, n)
        tail = c.pages[-1]
        if pool.ref_count(tail) == 1:
            child = self._add(c.fork(), [[list(k), list(v)] for k, v in self.shadow[h]])
        holders = [x for x in self.live if x is not h and tail in self.live[x].pages]
        w = data.draw(st.sampled_from([h] + holders), label="writer")
        writer = self.live[w]
        cap = min(ps - writer.length % ps, self._room(writer))
        if cap < 1:
            return child
        n = data.draw(st.integers(1, cap), label="rows into the shared tail")
        if pool.stats().free < 1:
            self._refused(lambda: fill_cache(writer, n), PoolExhausted, "pool_exhausted")
            return child
        others = [x for x in self.live.values() if x is not writer and tail in x.pages]
        before = [[dense_kv(x, layer) for layer in range(pool.num_layers)] for x in others]
        refs, copied = pool.ref_count(tail), pool.stats().pages_copied
        self._write(w, n)
        assert tail not in writer.pages and pool.ref_count(tail) == refs - 1
        assert pool.stats().pages_copied == copied + 1
        for x, kv in zip(others, before):
            assert tail in x.pages
            for layer in range(pool.num_layers):
                now = dense_kv(x, layer)
                assert all(np.array_equal(a, b) for a, b in zip(kv[layer], now)), "a shared page changed"
        return child

    @rule(target=released, h=consumes(caches))
    def release(self, h):
        c = self.live.pop(h)
        expect = [p for p in c.pages if self.pool.ref_count(p) == 1]
        freed = c.release()
        assert freed == expect, f"released {freed}, expected the sole-held pages {expect}"
        self.expect["frees"] += len(freed)
        self.gone[h] = c
        del self.shadow[h]
        return h

    @rule(h=consumes(released))
    def use_after_release(self, h):
        c = self.gone[h]
        self._refused(c.release, PageAlreadyFree, "already_free")
        self._refused(lambda: fill_cache(c, 1), ServingError, "released")
        self._refused(c.fork, ServingError, "released")

    @rule(data=st.data())
    def free_twice(self, data):
        """Invariant 4's error path: freeing a free page, or a live page once more than it has
        holders, and sharing a free page, are "already free" errors that change nothing."""
        pool = self.pool
        free = [p for p in range(pool.num_pages) if pool.ref_count(p) == 0]
        live = [p for p in range(pool.num_pages) if pool.ref_count(p) > 0]
        if free:
            p = data.draw(st.sampled_from(free), label="free page")
            self._refused(lambda: pool.free([p]), PageAlreadyFree, "already_free")
            self._refused(lambda: pool.share([p]), PageAlreadyFree, "already_free")
        if live:
            p = data.draw(st.sampled_from(live), label="live page")
            self._refused(lambda: pool.free([p] * (pool.ref_count(p) + 1)), PageAlreadyFree, "already_free")

    @precondition(lambda self: self.pool.stats().free > 0)
    @rule(target=caches, data=st.data())
    def exhaust(self, data):
        """A new cache appends until the pool is exhausted; the refused append, an
        oversized allocate and an oversized reserve of every live cache change nothing.
        The new cache is released again, or kept one time in four (the pool stays full)."""
        pool = self.pool
        h = self._add(PagedCache(pool))
        c = self.live[h]
        for _ in range(pool.num_pages * pool.page_size + 1):  # each write adds >= 1 position
            n = data.draw(st.integers(1, 2 * pool.page_size), label="chunk")
            if self._need(c, n)[0] > pool.stats().free:
                self._refused(lambda: fill_cache(c, n), PoolExhausted, "pool_exhausted")
                break
            self._write(h, n)
        else:
            raise AssertionError("appends never exhausted the pool: pages are not being allocated")
        self._refused(lambda: pool.allocate(pool.stats().free + 1), PoolExhausted, "pool_exhausted")
        for x in self.live.values():
            big = (len(x.pages) + pool.stats().free + 1) * pool.page_size - x.length
            if x.max_tokens is None:
                self._refused(lambda: x.reserve(big), PoolExhausted, "pool_exhausted")
        event("exhausted the pool")
        if data.draw(st.integers(0, 3), label="keep it (3)") != 3:
            pages = list(c.pages)
            assert c.release() == pages, "a private cache's release frees each of its pages"
            self.expect["frees"] += len(pages)
            self.gone[h] = self.live.pop(h)
            del self.shadow[h]
            return multiple()
        return h

    # -- invariants -------------------------------------------------------------------------
    @invariant()
    def inv1_length_is_positions_written(self):
        for h, c in self.live.items():
            for layer, (ks, vs) in enumerate(self.shadow[h]):
                k, v = dense_kv(c, layer)
                assert c.length == sum(len(x) for x in ks) == len(k)
                if ks:
                    assert np.array_equal(k, np.concatenate(ks)) and np.array_equal(v, np.concatenate(vs)), \
                        f"{h} layer {layer}: K/V read back differ from what was written"

    @invariant()
    def inv2_paged_attention_equals_dense(self):
        caches = list(self.live.values())
        if not caches:
            return
        self.checks += 1
        pool, B = self.pool, len(caches)
        lens = [c.length for c in caches]
        L = min([1 + self.checks % 3] + [n for n in lens if n])
        table = np.full((B, max([1] + [len(c.pages) for c in caches])), -1, dtype=np.int32)
        for b, c in enumerate(caches):
            table[b, :len(c.pages)] = c.pages
        rng = np.random.default_rng(self.checks)
        q = mx.array(rng.standard_normal((B, Q_HEADS, L, pool.head_dim)).astype(np.float32)).astype(pool.dtype)
        mask, window = ATTENTION[self.checks % len(ATTENTION)]
        for layer in range(pool.num_layers):
            out = impl.paged_attention(q, pool.keys(layer), pool.values(layer), mx.array(table),
                                       mx.array(np.array(lens, dtype=np.int32)), pool.page_size,
                                       mask=mask, window=window)
            mx.eval(out)
            assert not np.isnan(to_numpy(out)).any()
            _check_attention(q, [dense_kv(c, layer) for c in caches], out, mask, window)

    @invariant()
    def inv3_ownership(self):
        assert_ownership(self.pool, *self.live.values(), *self.gone.values())
        for c in self.live.values():
            assert len(set(c.pages)) == len(c.pages)

    @invariant()
    def inv4_no_leak_no_double_free(self):
        s = self.pool.stats()
        assert (s.allocations, s.frees, s.pages_copied) == tuple(self.expect.values()), (s, self.expect)
        _check_stats(self.pool, self.live.values())
        assert all(c.pages == [] and c.length == 0 and c.released for c in self.gone.values())
        assert pool_copies() == self.copies, "a pool update copied a whole layer"

    @invariant()
    def inv5_pages_follow_length(self):
        for c in self.live.values():
            assert len(c.pages) == -(-c.length // self.pool.page_size)

    @invariant()
    def inv9_unused_slots_are_nan(self):
        assert_unused_nan(self.pool, *self.live.values())


TestPoolMachine = PoolMachine.TestCase


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
                _check_attention(q, dense, out)
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
        _check_stats(self.pool, self.store.caches.values())
        assert pool_copies() == self.copies, "a pool update copied a whole layer"

    @invariant()
    def inv5_pages_follow_length(self):
        for c in self.store.caches.values():
            assert len(c.pages) == math.ceil(c.length / self.pool.page_size)

    @invariant()
    def inv9_unused_slots_are_nan(self):
        assert_unused_nan(self.pool, *self.store.caches.values())


TestSchedulerMachine = SchedulerMachine.TestCase
