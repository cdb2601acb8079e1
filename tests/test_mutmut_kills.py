"""What mutmut showed unpinned in the serving core (`python -m mutants.mutmut_run`):
each case below kills mutants of impl/{allocator,pool,cache,scheduler}.py that survived
the rest of the correctness suite (impl/validation.py's: test_mutmut_kills_contract.py).

| area                       | pinned here                                                   |
|----------------------------|---------------------------------------------------------------|
| prepared slots             | rechecked after any reference-count change, checked once otherwise |
| serving error messages     | every misuse's exact message (it names the offender), state untouched |
| pool                       | attributes, default no poisoning, poisoning in every dtype     |
| cache                      | a fork keeps `max_tokens`                                      |
| scheduler                  | a whole run step by step (prefills vs decodes, victims, request |
|                            | fields, `complete()`'s return, `peak_running`); edge requests; misuse messages |
"""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from fixtures.serving import (assert_same_state, changed_slots, dense_kv, fill_cache, make_pool, pool_rows,
                              pool_state, scheduled_steps)
from impl.cache import PagedCache
from impl.errors import ServingError
from impl.pool import PagePool
from impl.scheduler import Request, Scheduler, State, Step
from tests.test_scheduler import scheduler
from tests.test_scheduler import state as scheduler_state
from tests.test_serving_invariants import MISUSES, _one, _world

pytestmark = [pytest.mark.correctness, pytest.mark.builtin_only("pagecheck's own page pool, cache and scheduler")]


# -- prepared slots ---------------------------------------------------------------------
# Pages 0 and 1 allocated, slots [1, 4] prepared; then a change after which they are
# stale. The allocator's version must differ from the prepared one after any change,
# including an allocation of nothing after a free or share (a version that stepped back
# or stood still would let the write through unchecked).
STALE = {
    "free": (lambda pool: pool.free([0]), "slot"),
    "share": (lambda pool: pool.share([1]), "shared_write"),
    "free-then-allocate-none": (lambda pool: (pool.free([0]), pool.allocate(0)), "slot"),
    "share-then-allocate-none": (lambda pool: (pool.share([1]), pool.allocate(0)), "shared_write"),
}


@pytest.mark.parametrize("name", list(STALE))
def test_prepared_slots_are_rechecked_after_any_reference_count_change(name):
    change, clause = STALE[name]
    pool = make_pool()
    pool.allocate(2)
    prepared = pool.prepare_slots([1, 4])
    change(pool)
    before = pool_state(pool)
    with pytest.raises(ServingError) as e:
        pool.write(0, prepared, pool_rows(pool, 2), pool_rows(pool, 2))
    assert e.value.clause == clause
    assert_same_state(before, pool_state(pool))


def test_prepared_slots_are_checked_once_for_every_layer(monkeypatch):
    """A `Slots` from `prepare_slots` holds for this pool's allocator at its version:
    writes into every layer reuse the check until a page is allocated, shared or freed."""
    pool = make_pool()
    pool.allocate(2)
    checks = []
    real = PagePool._check_slots
    monkeypatch.setattr(PagePool, "_check_slots", lambda self, slots: checks.append(1) or real(self, slots))
    prepared = pool.prepare_slots([1, 4])
    assert (prepared.allocator, prepared.version, prepared.host.tolist()) == \
        (pool.allocator, pool.allocator.version, [1, 4])
    for layer in range(2):
        pool.write(layer, prepared, pool_rows(pool, 2, seed=layer), pool_rows(pool, 2, seed=5 + layer))
    assert len(checks) == 1
    pool.allocate(1)
    pool.write(0, prepared, pool_rows(pool, 2), pool_rows(pool, 2))
    assert len(checks) == 2


# -- serving error messages -------------------------------------------------------------
# The world of test_serving_invariants (pool of 5 pages: a and its fork b on [0, 1],
# c on [2, 3] with max_tokens=8, d released, page 4 free), its misuses and more; each
# raises its clause with exactly this message (errors.py: the message names the
# offending argument, request or page) and changes nothing.
MORE_MISUSES = {
    "append-values-short": (lambda w: w.c.append([_one(w)] * 2, [_one(w)]), "append_shape"),
    "append-keys-lengths-differ": (lambda w: w.c.append([_one(w, 2), _one(w)], [_one(w, 2)] * 2), "append_shape"),
    "write-keys-not-array": (lambda w: w.pool.write(0, [8], np.zeros((1, 2, 8), np.float32), _one(w)),
                             "append_shape"),
    "write-values-not-array": (lambda w: w.pool.write(0, [8], _one(w), [[0.0] * 8] * 2), "append_shape"),
    "write-values-shape": (lambda w: w.pool.write(0, [8], _one(w), _one(w, 2)), "append_shape"),
    "write-keys-dtype": (lambda w: w.pool.write(0, [8], _one(w, dtype=mx.float16), _one(w)), "append_dtype"),
    "copy-counts-differ": (lambda w: w.pool.copy_pages([2], [3, 2]), "page_id"),
    "copy-onto-its-source": (lambda w: w.pool.copy_pages([2], [2]), "page_id"),
    "pool-num-layers": (lambda w: make_pool(num_layers=0), "capacity"),
    "pool-kv-heads": (lambda w: make_pool(kv_heads=0), "capacity"),
    "pool-head-dim": (lambda w: make_pool(head_dim=2.0), "capacity"),
    "pool-page-size": (lambda w: make_pool(page_size=-4), "capacity"),
    "pool-dtype": (lambda w: make_pool(dtype=mx.int32), "append_dtype"),
    "pool-two-sizes": (lambda w: make_pool(num_pages=4, capacity_bytes=4096), "capacity"),
    "pool-float-bytes": (lambda w: make_pool(capacity_bytes=4096.0), "capacity"),
    "pool-too-few-bytes": (lambda w: make_pool(capacity_bytes=1023), "capacity"),
    "cache-max-tokens": (lambda w: PagedCache(w.pool, max_tokens=-1), "capacity"),
}
MESSAGES = {
    "double-free": "page 4 is already free",
    "free-listed-twice": "page 3 has 1 reference(s) but is freed 2 times",
    "free-shared-thrice": "page 0 has 2 reference(s) but is freed 3 times",
    "free-live-and-free": "page 4 is already free",
    "share-free-page": "page 4 is free; only a live page can be shared",
    "release-twice": "this cache was released already; its pages went back once",
    "write-free-page": "page 4 is free: a write goes into an allocated page",
    "copy-into-free-page": "page 4 is free; copies go between live pages",
    "use-after-release": "this paged cache was released; make a new one",
    "fork-after-release": "this paged cache was released; make a new one",
    "free-foreign--1": "page id -1 is outside the pool [0, 5)",
    "free-foreign-5": "page id 5 is outside the pool [0, 5)",
    "free-foreign-1.5": "page id must be an int, got 1.5",
    "free-foreign-True": "page id True is outside the pool [0, 5)",
    "share-foreign--1": "page id -1 is outside the pool [0, 5)",
    "share-foreign-5": "page id 5 is outside the pool [0, 5)",
    "share-foreign-1.5": "page id must be an int, got 1.5",
    "share-foreign-True": "page id True is outside the pool [0, 5)",
    "append-heads": "layer 0 rows have shape (1, 1, 8), expected (1, 2, 8)",
    "append-layers": "append needs K and V for all 2 layers, got 1 and 1",
    "append-kv-lengths": "layer 0 rows have shape (2, 2, 8), expected (1, 2, 8)",
    "append-dtype": "rows dtype mlx.core.float16 differs from the pool's mlx.core.float32",
    "append-past-max-tokens": "appending 2 positions to 7 exceeds max_tokens=8",
    "reserve-negative": "a position count must be an int >= 0, got -1",
    "reserve-bool": "a position count must be an int >= 0, got True",
    "write-shared-page": "page 0 is shared by 2 holders; copy it before writing",
    "write-shared-tail": "page 1 is shared by 2 holders; copy it before writing",
    "layer-too-big": "layer 2 is outside [0, 2)",
    "layer-negative": "layer -1 is outside [0, 2)",
    "layer-bool-read": "layer True is outside [0, 2)",
    "duplicate-slot": "a slot appears twice in one write",
    "slot-outside-pool": "slot 20 is outside the pool [0, 20)",
    "slot-negative": "slot -1 is outside the pool [0, 20)",
    "slot-float": "slots must be a 1-D sequence of ints, got float64 (1,)",
    "rows-per-slot": "keys has shape (1, 2, 8), expected (2, 2, 8) ([tokens, kv_heads, head_dim], one row per slot)",
    "rows-dtype": "values dtype mlx.core.bfloat16 differs from the pool's mlx.core.float32",
    "slots-not-reserved": "positions [4, 7) are not all reserved (length 6)",
    "allocate-too-many": "need 2 free pages, the pool has 1 of 5 free",
    "copy-and-new-page": "need 2 free pages, the pool has 1 of 5 free",
    "copy-into-shared-page": "page 0 is shared by 2 holders; a copy may only overwrite a private page",
    "allocate-1.5": "a page count must be an int >= 0, got 1.5",
    "allocate-'2'": "a page count must be an int >= 0, got '2'",
    "allocate-None": "a page count must be an int >= 0, got None",
    "allocate-True": "a page count must be an int >= 0, got True",
    "allocate--1": "a page count must be an int >= 0, got -1",
    "slots-from-another-pool": "page 4 is free: a write goes into an allocated page",
    "append-values-short": "append needs K and V for all 2 layers, got 2 and 1",
    "append-keys-lengths-differ": "layer 1 rows have shape (1, 2, 8), expected (2, 2, 8)",
    "write-keys-not-array": "keys must be an mlx array, got ndarray",
    "write-values-not-array": "values must be an mlx array, got list",
    "write-values-shape": "values has shape (2, 2, 8), expected (1, 2, 8) ([tokens, kv_heads, head_dim], "
                          "one row per slot)",
    "write-keys-dtype": "keys dtype mlx.core.float16 differs from the pool's mlx.core.float32",
    "copy-counts-differ": "copy_pages got 1 sources and 2 destinations",
    "copy-onto-its-source": "copy_pages destinations must be distinct and not sources",
    "pool-num-layers": "num_layers must be an int >= 1, got 0",
    "pool-kv-heads": "kv_heads must be an int >= 1, got 0",
    "pool-head-dim": "head_dim must be an int >= 1, got 2.0",
    "pool-page-size": "page_size must be an int >= 1, got -4",
    "pool-dtype": "pool dtype must be float32, float16 or bfloat16, got mlx.core.int32",
    "pool-two-sizes": "give exactly one of num_pages and capacity_bytes",
    "pool-float-bytes": "the pool must hold at least one page, got num_pages=0 (capacity_bytes=4096.0, "
                        "1024 bytes a page)",
    "pool-too-few-bytes": "the pool must hold at least one page, got num_pages=0 (capacity_bytes=1023, "
                          "1024 bytes a page)",
    "cache-max-tokens": "max_tokens must be an int >= 0 or None, got -1",
}


@pytest.mark.parametrize("name", list(MESSAGES))
def test_serving_errors_say_exactly_what_was_wrong(name):
    misuse, clause = {**MISUSES, **MORE_MISUSES}[name]
    w = _world()
    before = pool_state(w.pool, w.a, w.b, w.c, w.d)
    with pytest.raises(ServingError) as e:
        misuse(w)
    assert (e.value.clause, str(e.value)) == (clause, MESSAGES[name])
    assert_same_state(before, pool_state(w.pool, w.a, w.b, w.c, w.d))


# -- pool -------------------------------------------------------------------------------
def test_pool_keeps_its_construction_arguments():
    pool = PagePool(num_layers=3, kv_heads=1, head_dim=4, page_size=2, num_pages=5, dtype=mx.float16, fill=0.5)
    assert (pool.num_layers, pool.kv_heads, pool.head_dim, pool.page_size, pool.num_pages, pool.dtype,
            pool.fill, pool.poison_freed, pool.bytes_per_page) == (3, 1, 4, 2, 5, mx.float16, 0.5, False,
                                                                     2 * 3 * 1 * 2 * 4 * 2)
    assert all((np.array(x) == 0.5).all() for layer in range(3) for x in (pool.keys(layer), pool.values(layer)))


def test_freed_pages_keep_their_bits_unless_the_pool_poisons():
    """poison_freed is off by default: freeing changes bookkeeping, never K/V."""
    pool = make_pool()
    cache = PagedCache(pool)
    fill_cache(cache, 6)
    before = pool_state(pool)
    assert cache.release() == [0, 1]
    after = pool_state(pool)
    assert not changed_slots(before, after) and after.allocator[2] == replace(before.allocator[2], live=0, free=12,
                                                                               frees=2)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_poisoning_writes_nan_in_the_pool_dtype(dtype):
    pool = make_pool(dtype=dtype, poison_freed=True)
    cache = PagedCache(pool)
    fill_cache(cache, 6)
    before = pool_state(pool)
    cache.release()
    after = pool_state(pool)
    assert changed_slots(before, after) == {(kind, layer, s) for kind in ("keys", "values")
                                            for layer in range(2) for s in range(6)}
    assert all(np.isnan(np.array(x.astype(mx.float32))).all()
               for layer in range(2) for x in (pool.keys(layer), pool.values(layer)))


# -- cache ------------------------------------------------------------------------------
def test_fork_keeps_max_tokens():
    pool = make_pool()
    parent = PagedCache(pool, max_tokens=7)
    fill_cache(parent, 5)
    child = parent.fork()
    assert (child.max_tokens, child.snapshot()) == (7, parent.snapshot())
    fill_cache(child, 2)
    before = pool_state(pool, parent, child)
    with pytest.raises(ServingError) as e:
        fill_cache(child, 1)
    assert (e.value.clause, str(e.value)) == ("capacity", "appending 1 positions to 7 exceeds max_tokens=7")
    assert_same_state(before, pool_state(pool, parent, child))


def test_a_cache_may_hold_nothing():
    """max_tokens=0 is a valid cap; an empty cache's slots are int64 like any others."""
    pool = make_pool()
    cache = PagedCache(pool, max_tokens=0)
    before = pool_state(pool, cache)
    slots = cache.reserve(0)
    assert (slots.dtype, slots.shape, cache.slots(0, 0).dtype) == (np.int64, (0,), np.int64)
    assert (cache.max_tokens, cache.snapshot()) == (0, ((), 0, False))
    with pytest.raises(ServingError) as e:
        cache.reserve(1)
    assert (e.value.clause, str(e.value)) == ("capacity", "appending 1 positions to 0 exceeds max_tokens=0")
    assert_same_state(before, pool_state(pool, cache))


@pytest.mark.parametrize("n,parent_pages,child_pages,refs", [(2, [0], [1], [1, 1, 0, 0]),
                                                            (10, [0, 1, 2], [0, 1, 3], [2, 2, 1, 1])])
def test_copy_on_write_copies_the_tail_page_wherever_it_is(n, parent_pages, child_pages, refs):
    """The shared partial tail is the last page of the table: the only page (n=2) or
    the third (n=10); the child's copy replaces it there and nowhere else."""
    pool = make_pool()
    parent = PagedCache(pool)
    fill_cache(parent, n, seed=1)
    child = parent.fork()
    before = pool_state(pool, parent)
    fill_cache(child, 1, seed=2)
    after = pool_state(pool, parent)
    assert (parent.pages, child.pages, child.length, pool.stats().pages_copied) == \
        (parent_pages, child_pages, n + 1, 1)
    assert [pool.ref_count(p) for p in range(4)] == refs
    assert after.caches == before.caches
    assert {s // 4 for _, _, s in changed_slots(before, after)} == {child_pages[-1]}
    for layer in range(2):
        child_k, child_v = dense_kv(child, layer)
        parent_k, parent_v = dense_kv(parent, layer)
        assert np.array_equal(child_k[:n], parent_k) and np.array_equal(child_v[:n], parent_v)


# -- scheduler --------------------------------------------------------------------------
def _requests(reqs):
    return [(r.rid, r.state, r.computed, r.generated, r.preemptions, r.admitted) for r in reqs]


W, R, F = State.WAITING, State.RUNNING, State.FINISHED
# 4 pages of 4, three requests of 4 prompt + 6 new positions, prefill_step 4. Per step:
# prefills (rid, start, count), decodes (rid, start), preempted, finished, then every
# request's (rid, state, computed, generated, preemptions, admitted) after complete().
RUN = [
    ([(0, 0, 4), (1, 0, 4), (2, 0, 4)], [], [], [], [(0, R, 4, 0, 0, 0), (1, R, 4, 0, 0, 1), (2, R, 4, 0, 0, 2)]),
    ([], [(0, 4), (1, 4)], [2], [], [(0, R, 5, 1, 0, 0), (1, R, 5, 1, 0, 1), (2, W, 0, 0, 1, -1)]),
    ([], [(0, 5), (1, 5)], [], [], [(0, R, 6, 2, 0, 0), (1, R, 6, 2, 0, 1), (2, W, 0, 0, 1, -1)]),
    ([], [(0, 6), (1, 6)], [], [], [(0, R, 7, 3, 0, 0), (1, R, 7, 3, 0, 1), (2, W, 0, 0, 1, -1)]),
    ([], [(0, 7), (1, 7)], [], [], [(0, R, 8, 4, 0, 0), (1, R, 8, 4, 0, 1), (2, W, 0, 0, 1, -1)]),
    ([], [(0, 8)], [1], [], [(0, R, 9, 5, 0, 0), (1, W, 0, 4, 1, -1), (2, W, 0, 0, 1, -1)]),
    ([], [(0, 9)], [], [0], [(0, F, 10, 6, 0, 0), (1, W, 0, 4, 1, -1), (2, W, 0, 0, 1, -1)]),
    ([(1, 0, 4), (2, 0, 4)], [], [], [], [(0, F, 10, 6, 0, 0), (1, R, 4, 4, 1, 3), (2, R, 4, 0, 1, 4)]),
    ([(1, 4, 4)], [(2, 4)], [], [], [(0, F, 10, 6, 0, 0), (1, R, 8, 4, 1, 3), (2, R, 5, 1, 1, 4)]),
    ([], [(1, 8)], [2], [], [(0, F, 10, 6, 0, 0), (1, R, 9, 5, 1, 3), (2, W, 0, 1, 2, -1)]),
    ([], [(1, 9)], [], [1], [(0, F, 10, 6, 0, 0), (1, F, 10, 6, 1, 3), (2, W, 0, 1, 2, -1)]),
    ([(2, 0, 4)], [], [], [], [(0, F, 10, 6, 0, 0), (1, F, 10, 6, 1, 3), (2, R, 4, 1, 2, 5)]),
    ([(2, 4, 1)], [], [], [], [(0, F, 10, 6, 0, 0), (1, F, 10, 6, 1, 3), (2, R, 5, 1, 2, 5)]),
    *[([], [(2, p)], [], [2] if p == 9 else [],
       [(0, F, 10, 6, 0, 0), (1, F, 10, 6, 1, 3), (2, F if p == 9 else R, p + 1, p - 3, 2, 5)])
      for p in range(5, 10)],
]


def test_a_whole_run_step_by_step():
    """Preemption picks the youngest of three, twice the same request; a recompute
    prefills prompt and decoded positions; an older request prefills while a younger
    decodes. Every request field is checked after every step."""
    sched, store = scheduler(4, prefill_step=4)
    reqs = [Request(rid, prompt_len=4, max_new_tokens=6) for rid in range(3)]
    for r in reqs:
        sched.add(r)
    assert (sched.peak_running, _requests(reqs)) == (0, [(rid, W, 0, 0, 0, -1) for rid in range(3)])
    seen = []
    for step in scheduled_steps(sched):
        finished = sched.complete(step)
        assert not any(w.decode for w in step.prefills) and all(w.decode and w.count == 1 for w in step.decodes)
        seen.append(([(w.request.rid, w.start, w.count) for w in step.prefills],
                     [(w.request.rid, w.start) for w in step.decodes],
                     [r.rid for r in step.preempted], [r.rid for r in finished], _requests(reqs)))
    assert seen == RUN
    assert (sched.peak_running, [r.rid for r in sched.done], store.pool.stats().free) == (3, [0, 1, 2], 4)


def test_a_scheduler_that_ran_nothing_has_peak_zero():
    sched, store = scheduler(4)
    sched.complete(sched.schedule())
    assert (sched.peak_running, scheduler_state(sched, store)) == (0, ([], [], {}, 4))


@pytest.mark.parametrize("prompt_len,output_len,plans", [
    (1, 0, [[(0, 0, 1, False)]]),
    (1, 1, [[(0, 0, 1, False)], [(0, 1, 1, True)]]),
    (5, 0, [[(0, 0, 4, False)], [(0, 4, 1, False)]]),
])
def test_the_shortest_requests_run(prompt_len, output_len, plans):
    """prompt_len 1 and output_len 0 are the smallest accepted: such a request
    prefills and finishes without a decode."""
    sched, store = scheduler(4)
    req = Request(0, prompt_len=prompt_len, max_new_tokens=1, output_len=output_len)
    sched.add(req)
    seen = []
    for step in scheduled_steps(sched):
        seen.append([(w.request.rid, w.start, w.count, w.decode) for w in step.works])
        sched.complete(step)
    assert seen == plans
    assert (_requests([req]), sched.done, scheduler_state(sched, store)) == \
        ([(0, F, prompt_len + output_len, output_len, 0, 0)], [req], ([], [], {}, 4))


@pytest.mark.parametrize("max_batch,prefill_step,message", [
    (0, 4, "max_batch and prefill_step must be >= 1, got 0, 4"),
    (4, 0, "max_batch and prefill_step must be >= 1, got 4, 0"),
])
def test_scheduler_limits_are_checked(max_batch, prefill_step, message):
    _, store = scheduler(4)
    with pytest.raises(ServingError) as e:
        Scheduler(store, max_batch=max_batch, prefill_step=prefill_step)
    assert (type(e.value), e.value.clause, str(e.value)) == (ServingError, "capacity", message)


# Request 0 (prompt 6, 2 new) is running on a pool of 12 pages; `in_flight` says whether
# its step was scheduled and not completed yet.
SCHEDULER_MISUSES = {
    "duplicate-id": (False, lambda s: s.add(Request(0, prompt_len=1, max_new_tokens=1)), "request",
                     "request id 0 was added already"),
    "empty-prompt": (False, lambda s: s.add(Request(5, prompt_len=0, max_new_tokens=1)), "request",
                     "request 5: prompt_len must be >= 1 and 0 <= output_len <= max_new_tokens"),
    "output-past-cap": (False, lambda s: s.add(Request(5, prompt_len=1, max_new_tokens=1, output_len=2)), "request",
                        "request 5: prompt_len must be >= 1 and 0 <= output_len <= max_new_tokens"),
    "never-fits": (False, lambda s: s.add(Request(5, prompt_len=40, max_new_tokens=9)), "capacity",
                   "request 5 (40 + 9 positions) can never fit in the KV store, even alone"),
    "abort-unknown": (False, lambda s: s.abort(9), "request", "request 9 is neither waiting nor running"),
    "complete-unscheduled": (False, lambda s: s.complete(Step()), "request",
                             "complete() takes the step returned by the last schedule()"),
    "schedule-in-flight": (True, lambda s: s.schedule(), "request",
                           "complete() the previous step before scheduling another"),
    "complete-another-step": (True, lambda s: s.complete(Step()), "request",
                              "complete() takes the step returned by the last schedule()"),
    "abort-in-flight": (True, lambda s: s.abort(0), "request", "abort between steps, not while one is in flight"),
}


@pytest.mark.parametrize("name", list(SCHEDULER_MISUSES))
def test_scheduler_errors_say_exactly_what_was_wrong(name):
    in_flight, misuse, clause, message = SCHEDULER_MISUSES[name]
    sched, store = scheduler(12)
    req = Request(0, prompt_len=6, max_new_tokens=2)
    sched.add(req)
    step = sched.schedule()
    if not in_flight:
        sched.complete(step)
    before = (scheduler_state(sched, store), _requests([req]), pool_state(store.pool, *store.caches.values()))
    with pytest.raises(ServingError) as e:
        misuse(sched)
    assert (type(e.value), e.value.clause, str(e.value)) == (ServingError, clause, message)
    assert (scheduler_state(sched, store), _requests([req])) == before[:2]
    assert_same_state(before[2], pool_state(store.pool, *store.caches.values()))


# Run in a fresh interpreter: MLX's active-memory counter is process-wide, and in a test
# worker another test's arrays or threads can move it between the two reads (CI 2026-12-03:
# 9216 bytes more than the pool, once, in one xdist order).
_CAPACITY_PROBE = """
import gc, mlx.core as mx
from impl.pool import PagePool
for n in (64, 32):
    gc.collect()
    before = mx.get_active_memory()
    pool = PagePool(num_layers=2, kv_heads=8, head_dim=128, page_size=16, num_pages=n, kv_dtype="int8",
                    scales="token")
    print(n, mx.get_active_memory() - before, pool.bytes_per_page)
    del pool
"""


def test_a_pool_holds_its_whole_capacity_once_built():
    """The capacity is taken at construction (module docstring: nothing grows): the pages
    and token scales exist when the constructor returns, exactly bytes_per_page a page
    (mutmut 2026-12-03: token scales left lazy until their first write survived)."""
    import os
    import subprocess
    import sys

    # Built here too: mutmut runs a mutant's tests only where its stats run saw them reach
    # the mutated function in this process (2026-12-03: the subprocess alone left the
    # mx.eval mutants of the constructor unrun, survived); the subprocess inherits the
    # mutant under test through the environment.
    PagePool(num_layers=1, kv_heads=1, head_dim=8, page_size=4, num_pages=1, kv_dtype="int8", scales="token")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", _CAPACITY_PROBE], cwd=root, check=True, capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": root}).stdout
    grown = [tuple(map(int, line.split())) for line in out.splitlines()]
    # 2 layers x K,V x 8 heads x 16 rows x (128 int8 codes + one float32 token scale), and
    # a cache line more in each of the 4 page arrays (their data starts on one: aligned_copy)
    assert grown == [(n, n * 67584 + 4 * 64, 67584) for n in (64, 32)]
