"""The continuous-batching scheduler and its engines: admission, chunked prefill,
decode, preemption with recompute, finishing and aborting, and the three engine
variants agreeing bit for bit on one trace."""

from __future__ import annotations

import collections
import dataclasses

import mlx.core as mx
import numpy as np
import pytest

import impl.engine
from bench.serving import run_variant
from fixtures.serving import make_pool, scheduled_steps
from fixtures.trace import SMALL
from impl.errors import PoolExhausted, ServingError
from impl.scheduler import Request, Scheduler, State
from impl.stores import DenseStore, PagedStore

pytestmark = [pytest.mark.correctness, pytest.mark.builtin_only("pagecheck's own page pool, cache and scheduler")]




def scheduler(num_pages, *, max_batch=4, prefill_step=4):
    store = PagedStore(make_pool(num_pages=num_pages))
    return Scheduler(store, max_batch=max_batch, prefill_step=prefill_step), store


def plan(step):
    """A step as data: ((rid, start, count, decode) per work, preempted rids)."""
    return ([(w.request.rid, w.start, w.count, w.decode) for w in step.works],
            [r.rid for r in step.preempted])


def state(sched, store):
    return ([r.rid for r in sched.running], [r.rid for r in sched.waiting],
            {rid: (c.pages, c.length) for rid, c in store.caches.items()}, store.pool.stats().free)


def test_chunked_prefill_then_one_decode_per_step():
    sched, store = scheduler(12)
    sched.add(Request(0, prompt_len=10, max_new_tokens=3))
    plans = []
    for step in scheduled_steps(sched):
        plans.append(plan(step))
        sched.complete(step)
    assert plans == [([(0, 0, 4, False)], []), ([(0, 4, 4, False)], []), ([(0, 8, 2, False)], []),
                     ([(0, 10, 1, True)], []), ([(0, 11, 1, True)], []), ([(0, 12, 1, True)], [])]
    req, = sched.done
    assert (req.state, req.computed, req.generated, store.caches, store.pool.stats().free) == \
        (State.FINISHED, 13, 3, {}, 12)


def test_admission_waits_until_the_pool_can_hold_the_prompt():
    sched, store = scheduler(6)
    for rid, prompt in enumerate((12, 12, 8)):
        sched.add(Request(rid, prompt_len=prompt, max_new_tokens=1))
    step = sched.schedule()
    # 0 and 1 claim 3 pages each for their prompts; 2 needs 2 more than the 6 there are.
    assert plan(step) == ([(0, 0, 4, False), (1, 0, 4, False)], [])
    assert state(sched, store) == ([0, 1], [2], {0: ([0], 4), 1: ([1], 4)}, 4)


def test_decode_without_a_page_preempts_the_youngest():
    sched, store = scheduler(4, prefill_step=8)
    for rid in (0, 1):
        sched.add(Request(rid, prompt_len=8, max_new_tokens=4))
    sched.complete(sched.schedule())                   # both prompts fill 2 pages each
    step = sched.schedule()                             # 0 needs a 5th page: 1 makes room
    assert plan(step) == ([(0, 8, 1, True)], [1])
    assert state(sched, store) == ([0], [1], {0: ([0, 1, 3], 9)}, 1)
    victim = sched.waiting[0]
    assert (victim.state, victim.computed, victim.preemptions) == (State.WAITING, 0, 1)
    sched.complete(step)


def test_the_youngest_preempts_itself():
    sched, store = scheduler(4, prefill_step=8)
    sched.add(Request(0, prompt_len=7, max_new_tokens=4))
    sched.add(Request(1, prompt_len=8, max_new_tokens=4))
    sched.complete(sched.schedule())   # all 4 pages live; 0's tail has one free slot
    step = sched.schedule()            # 0 decodes into its tail; 1 needs a page, is the youngest
    assert plan(step) == ([(0, 7, 1, True)], [1])
    assert state(sched, store) == ([0], [1], {0: ([0, 1], 8)}, 2)
    sched.complete(step)


def test_finished_and_aborted_requests_free_their_pages():
    sched, store = scheduler(12)
    for rid in range(3):
        sched.add(Request(rid, prompt_len=6, max_new_tokens=2))
    sched.complete(sched.schedule())
    sched.abort(1)
    assert state(sched, store) == ([0, 2], [], {0: ([0], 4), 2: ([2], 4)}, 10)
    sched.add(Request(3, prompt_len=4, max_new_tokens=1))
    assert sched.abort(3).state is State.ABORTED            # still waiting: nothing to free
    step = sched.schedule()
    with pytest.raises(ServingError) as e:
        sched.abort(0)                                      # not while a step is in flight
    assert e.value.clause == "request"
    sched.complete(step)
    for step in scheduled_steps(sched):
        sched.complete(step)
    assert {r.rid: r.state for r in sched.done} == {0: State.FINISHED, 1: State.ABORTED,
                                                    2: State.FINISHED, 3: State.ABORTED}
    assert (store.caches, store.pool.stats().live, store.leaked_pages()) == ({}, 0, 0)
    with pytest.raises(ServingError, match="neither waiting nor running"):
        sched.abort(0)


@pytest.mark.parametrize("request_, clause", [
    (Request(0, prompt_len=40, max_new_tokens=9), "capacity"),     # 49 positions > 12 pages of 4
    (Request(0, prompt_len=0, max_new_tokens=1), "request"),
    (Request(0, prompt_len=4, max_new_tokens=1, output_len=2), "request"),
])
def test_requests_that_cannot_run_are_refused(request_, clause):
    sched, store = scheduler(12)
    with pytest.raises(ServingError) as e:
        sched.add(request_)
    assert e.value.clause == clause
    assert (list(sched.waiting), store.pool.stats().free) == ([], 12)


def _emissions(budget_tokens):
    seen = collections.defaultdict(list)
    metrics, _ = run_variant(SMALL, "paged", budget_tokens,
                             emit=lambda rid, layer, pos, row: seen[(rid, layer, pos)].append(row.tobytes()))
    return metrics, seen


def test_preempted_then_recomputed_requests_match_uninterrupted_ones():
    calm, reference = _emissions(budget_tokens=1024)
    tight, seen = _emissions(budget_tokens=64)
    assert calm["preemptions"] == 0 and tight["preemptions"] > 0
    assert seen.keys() == reference.keys()
    recomputed = [k for k, rows in seen.items() if len(rows) > 1]
    assert recomputed, "the tight pool should have made some positions run twice"
    for key, rows in seen.items():
        assert all(r == reference[key][0] for r in rows), key
    assert (tight["leaked_pages"], tight["whole_pool_copies"]) == (0, 0)


def test_variants_agree_bit_for_bit_and_leak_nothing():
    digests = {}
    for variant in impl.engine.VARIANTS:
        metrics, digests[variant] = run_variant(SMALL, variant)
        assert (metrics["leaked_pages"], metrics["whole_pool_copies"]) == (0, 0), variant
    total = sum(p + o for _, p, o in SMALL.requests()) * SMALL.layers
    assert len(digests["paged"]) == total
    assert digests["paged"] == digests["paged_gather"] == digests["dense"]


@pytest.mark.parametrize("variant, builds", [("paged", 1), ("paged_gather", 2), ("dense", 1)])
def test_metadata_is_built_once_per_group_not_per_layer(monkeypatch, variant, builds):
    calls = collections.Counter()
    real = impl.engine.PagedMetadata.build.__func__

    def counting(cls, *args, **kwargs):
        calls["build"] += 1
        return real(cls, *args, **kwargs)
    monkeypatch.setattr(impl.engine.PagedMetadata, "build", classmethod(counting))
    for layers in (1, 3):
        calls.clear()
        metrics, _ = run_variant(dataclasses.replace(SMALL, num_requests=2, layers=layers), variant)
        groups = calls["build"] / builds
        assert groups == int(groups)
        if layers == 1:
            one_layer = calls["build"]
    assert calls["build"] == one_layer, "metadata must not be rebuilt per layer"


def dense_store(budget_tokens, slot_tokens):
    return DenseStore(num_layers=2, kv_heads=2, head_dim=4, dtype=mx.float32, budget_tokens=budget_tokens,
                      slot_tokens=slot_tokens)


def dense_state(store):
    return (dict(store.reserved), dict(store.bounds), dict(store.lengths), store.held_bytes(),
            store.fitted_bytes(), store.tail_waste_slots())


def test_dense_static_slots_reserve_the_slot_and_report_the_fitted_bound():
    store = dense_store(budget_tokens=100, slot_tokens=40)
    per_token = 2 * 2 * 2 * 4 * 4  # K and V, layers, heads, D, float32
    a, b, c = Request(0, 10, 5), Request(1, 20, 10), Request(2, 35, 6)
    assert (store.could_ever_hold(a), store.could_ever_hold(c)) == (True, False)  # 41 > slot of 40
    assert store.could_ever_hold(Request(9, 30, 10))  # exactly a slot
    assert not dense_store(budget_tokens=39, slot_tokens=40).could_ever_hold(a)  # a slot over the budget
    store.admit(a)
    store.reserve(a, 12)
    assert store.can_admit(b, [])
    store.admit(b)
    assert not store.can_admit(Request(3, 1, 1), [])  # 3 slots of 40 > 100, however small
    assert dense_state(store) == ({0: 40, 1: 40}, {0: 15, 1: 30}, {0: 12, 1: 0}, 80 * per_token,
                                  45 * per_token, 28 + 40)
    before = dense_state(store)
    with pytest.raises(PoolExhausted, match="outgrew its dense reservation of 40"):
        store.reserve(a, 29)
    assert dense_state(store) == before
    store.reserve(a, 28)  # up to the slot exactly
    assert store.lengths[0] == 40 and store.tail_waste_slots() == 40
    store.release(a)
    assert dense_state(store) == ({1: 40}, {1: 30}, {1: 0}, 40 * per_token, 30 * per_token, 40)
    tight = dense_store(budget_tokens=80, slot_tokens=40)
    tight.admit(a)
    assert tight.can_admit(b, [])  # two slots fill the budget exactly


def test_dense_without_slots_reserves_prompt_plus_cap():
    store = dense_store(budget_tokens=50, slot_tokens=None)
    a, b = Request(0, 10, 5), Request(1, 30, 6)
    store.admit(a)
    assert store.could_ever_hold(b) and store.can_admit(b, []) is False  # 15 + 36 > 50
    assert dense_state(store)[:2] == ({0: 15}, {0: 15}) and store.held_bytes() == store.fitted_bytes()


@pytest.mark.parametrize("slot", [0, -3])
def test_dense_slot_size_must_be_positive(slot):
    with pytest.raises(ServingError, match=f"slot_tokens must be >= 1 or None, got {slot}") as err:
        dense_store(budget_tokens=10, slot_tokens=slot)
    assert err.value.clause == "capacity"
    assert dense_store(budget_tokens=10, slot_tokens=1).slot_tokens == 1


def test_dense_budget_must_be_positive_and_may_be_one_slot():
    with pytest.raises(ServingError, match="budget_tokens must be >= 1, got 0") as err:
        dense_store(budget_tokens=0, slot_tokens=None)
    assert err.value.clause == "capacity"
    assert dense_store(budget_tokens=1, slot_tokens=1).could_ever_hold(Request(0, 1, 0))
    assert dense_store(budget_tokens=40, slot_tokens=40).could_ever_hold(Request(0, 30, 10))  # slot == budget


def test_paged_store_counts_pages_bytes_and_leaks():
    store = PagedStore(make_pool(num_pages=12))  # pages of 4
    assert (store.pages_for(17), store.pages_for(16), store.pages_for(0)) == (5, 4, 0)
    running = Request(0, 10, 2)
    store.admit(running)
    store.reserve(running, 4)  # one of its three prompt pages so far, so 2 still needed
    assert store.can_admit(Request(1, 36, 2), [running])  # 9 pages + 2 == 11 free
    assert not store.can_admit(Request(2, 37, 2), [running])  # 10 + 2 > 11
    assert store.kv_bytes() == store.held_bytes() == store.fitted_bytes() == store.pool.bytes_per_page
    leaked = store.pool.allocator.allocate(2)
    assert store.leaked_pages() == 2 and len(leaked) == 2


@pytest.mark.parametrize("kv_dtype,scales", [("float8_e4m3fn", "token"), ("int8", "head"), ("float8_e5m2", "tensor")])
def test_quantized_pool_variants_agree_bit_for_bit(kv_dtype, scales):
    """A quantized pool through the whole serving trace: the gathering engine carries
    token scales with their rows (impl/engine.py _gathered_options), so it gives the paged
    engine's bits; nothing leaks, nothing copies a pool."""
    digests = {}
    for variant in ("paged", "paged_gather"):
        metrics, digests[variant] = run_variant(SMALL, variant, kv_dtype=kv_dtype, scales=scales)
        assert (metrics["leaked_pages"], metrics["whole_pool_copies"]) == (0, 0), variant
    assert digests["paged"] == digests["paged_gather"]
    _, unquantized = run_variant(SMALL, "paged")
    assert digests["paged"].keys() == unquantized.keys() and digests["paged"] != unquantized
