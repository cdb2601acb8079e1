"""Stateful test of the page pool and paged caches: random sequences of operations,
every invariant of REFERENCE.md section 2 that applies checked after every step.

`PoolMachine` drives one `PagePool` (poison_freed, NaN fill) and several `PagedCache`s
directly and keeps a shadow model: the rows written into each cache, per layer.
Rules: new cache, append, fork, write into a shared tail page (copy-on-write), release,
release again / use after release, free a page twice, exhaust the pool.

| check (after every step)        | PoolMachine                                              |
|---------------------------------|----------------------------------------------------------|
| 1 length == positions written   | == shadow rows; K/V bits == shadow                       |
| 2 paged == dense attention      | kernel over all caches vs float64 oracle on `dense_kv`   |
| 3 ownership                     | `assert_ownership`                                       |
| 4 no leak, no double free       | stats == model's allocations/frees/copies, live == union of holders |
| 5 ceil(length / page_size) pages| every live cache                                         |
| 9 unused slots NaN              | `assert_unused_nan`                                      |
| 10 refused call changes nothing | exhausted pool, max_tokens, double release, double free  |

The scheduler's machine is in tests/test_scheduler_machine.py.

Steps per example and examples come from the hypothesis profile (conftest.py).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import (Bundle, RuleBasedStateMachine, consumes, initialize, invariant, multiple, precondition,
                                 rule)

import impl
from fixtures import to_numpy
from fixtures.layouts import DTYPES
from fixtures.serving import (Q_HEADS, assert_ownership, assert_paged_equals_dense, assert_pool_stats,
                              assert_same_state, assert_unused_nan, dense_kv, fill_cache, make_pool, pool_state)
from impl.cache import PagedCache
from impl.errors import PageAlreadyFree, PoolExhausted, ServingError
from impl.pool import pool_copies

pytestmark = [pytest.mark.correctness, pytest.mark.builtin_only("pagecheck's own page pool, cache and scheduler")]

ATTENTION = (("causal", None), (None, None), ("causal", 2))


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
            assert_paged_equals_dense(q, [dense_kv(c, layer) for c in caches], out, mask, window)

    @invariant()
    def inv3_ownership(self):
        assert_ownership(self.pool, *self.live.values(), *self.gone.values())
        for c in self.live.values():
            assert len(set(c.pages)) == len(c.pages)

    @invariant()
    def inv4_no_leak_no_double_free(self):
        s = self.pool.stats()
        assert (s.allocations, s.frees, s.pages_copied) == tuple(self.expect.values()), (s, self.expect)
        assert_pool_stats(self.pool, self.live.values())
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
