"""REFERENCE.md invariants 1-10 through the scheduler: a whole trace served by
`Scheduler` + `PagedStore` + engines, each invariant a named test.

Bitwise ones compare the crc32 of every (request, layer, position) output row between
two runs of the same trace that differ only in what the invariant says must not
matter. Structural ones are checked after every step of a preemption-heavy run.
"""

from __future__ import annotations

import dataclasses

import pytest

import impl
from bench.serving import run_variant
from fixtures.serving import assert_ownership, assert_unused_nan, make_pool
from fixtures.trace import SMALL
from impl.errors import ServingError
from impl.scheduler import Request, Scheduler, Step
from impl.stores import PagedStore

pytestmark = [pytest.mark.correctness, pytest.mark.builtin_only("pagecheck's own page pool, cache and scheduler")]

TIGHT = 64          # tokens of KV: small enough that decodes preempt
CALM = 1024


def _per_step(check):
    """Runs SMALL in a tight pool with `check(scheduler, store)` after every step."""
    steps, stores = [], set()

    def on_step(sched, store, step):
        check(sched, store)
        steps.append(len(step.preempted))
        stores.add(store)
    metrics, _ = run_variant(SMALL, "paged", TIGHT, on_step=on_step, poison_freed=True)
    assert sum(steps) == metrics["preemptions"] > 0, "the tight pool should preempt"
    store, = stores
    return metrics, store


def _digests(trace=SMALL, variant="paged", budget=CALM, **pool_options):
    return run_variant(trace, variant, budget, **pool_options)[1]


def test_invariant_1_context_len_counts_written_positions():
    def check(sched, store):
        for req in sched.running:
            assert store.caches[req.rid].length == req.computed, req.rid
        assert set(store.caches) == {r.rid for r in sched.running}
    _per_step(check)


def test_invariant_2_paged_equals_dense_attention_on_gathered_kv():
    paged = _digests()
    assert paged == _digests(variant="paged_gather") == _digests(variant="dense")


def test_invariant_3_pages_owned_by_one_request_unless_shared():
    _per_step(lambda sched, store: assert_ownership(store.pool, *store.caches.values()))


def test_invariant_4_finished_aborted_and_preempted_requests_return_pages_once():
    def check(sched, store):
        assert store.leaked_pages() == 0
        held = [p for c in store.caches.values() for p in c.pages]
        assert len(held) == len(set(held)) == store.pool.stats().live
    metrics, store = _per_step(check)
    stats = store.pool.stats()
    # every allocation came back exactly once
    assert (metrics["leaked_pages"], stats.live, stats.frees) == (0, 0, stats.allocations)


def test_invariant_5_pages_follow_the_length():
    def check(sched, store):
        for c in store.caches.values():
            assert len(c.pages) == -(-c.length // c.page_size), (c.pages, c.length)
    _per_step(check)


def test_invariant_6_outputs_do_not_depend_on_the_batch():
    assert _digests() == _digests(dataclasses.replace(SMALL, batch=1))


def test_invariant_7_outputs_do_not_depend_on_worker_threads():
    before = impl.num_threads()
    try:
        impl.set_num_threads(1)
        one = _digests()
        impl.set_num_threads(3)
        assert _digests() == one
    finally:
        impl.set_num_threads(before)


def test_invariant_8_prefill_chunks_equal_decodes():
    # prefill_step=1 computes every prompt position as a one-token decode
    assert _digests() == _digests(dataclasses.replace(SMALL, prefill_step=1)) \
        == _digests(dataclasses.replace(SMALL, prefill_step=64))


def test_invariant_9_unused_slots_and_free_pages_never_read():
    nan = _digests(budget=TIGHT, poison_freed=True)
    assert nan == _digests(budget=TIGHT, fill=0.0) == _digests(budget=TIGHT, fill=1e30)
    _per_step(lambda sched, store: assert_unused_nan(store.pool, *store.caches.values()))


def _scheduler_state(sched, store):
    return ([(r.rid, r.state, r.computed, r.generated) for r in sched.running],
            [(r.rid, r.state) for r in sched.waiting], store.pool.allocator.snapshot(),
            {rid: c.snapshot() for rid, c in store.caches.items()})


def _busy_scheduler():
    """Two requests running (one page each), one waiting, no step in flight."""
    store = PagedStore(make_pool(num_pages=8))
    sched = Scheduler(store, max_batch=2, prefill_step=4)
    for rid in range(3):
        sched.add(Request(rid, prompt_len=6, max_new_tokens=2))
    sched.complete(sched.schedule())
    return sched, store


SCHEDULER_MISUSE = {
    "same-id-twice": (lambda s: s.add(Request(0, prompt_len=4, max_new_tokens=1)), "request"),
    "never-fits": (lambda s: s.add(Request(9, prompt_len=4000, max_new_tokens=1)), "capacity"),
    "empty-prompt": (lambda s: s.add(Request(9, prompt_len=0, max_new_tokens=1)), "request"),
    "output-over-cap": (lambda s: s.add(Request(9, prompt_len=4, max_new_tokens=1, output_len=3)), "request"),
    "abort-unknown": (lambda s: s.abort(77), "request"),
    "complete-without-step": (lambda s: s.complete(Step()), "request"),
}


@pytest.mark.parametrize("name", sorted(SCHEDULER_MISUSE))
def test_invariant_10_scheduler_misuse_leaves_state_untouched(name):
    misuse, clause = SCHEDULER_MISUSE[name]
    sched, store = _busy_scheduler()
    before = _scheduler_state(sched, store)
    assert before[0] and before[1], "the set-up must have running and waiting requests"
    with pytest.raises(ServingError) as e:
        misuse(sched)
    assert e.value.clause == clause
    assert _scheduler_state(sched, store) == before


def test_invariant_10_misuse_while_a_step_is_in_flight():
    sched, store = _busy_scheduler()
    step = sched.schedule()
    before = _scheduler_state(sched, store)
    for misuse in (lambda: sched.complete(Step()), lambda: sched.schedule(), lambda: sched.abort(0)):
        with pytest.raises(ServingError) as e:
            misuse()
        assert e.value.clause == "request"
        assert _scheduler_state(sched, store) == before
    sched.complete(step)
