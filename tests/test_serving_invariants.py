"""Serving-level invariants of REFERENCE.md section 2, each a named test: 1 context
lengths, 3 page ownership, 4 release, 5 page growth, 10 bad input leaves state alone."""

import dataclasses
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from fixtures.serving import (assert_ownership, assert_same_state, assert_unused_nan, dense_kv,
                              dense_layout, fill_cache, make_pool, pool_rows, pool_state, rows)
from impl.batch import StepBatch
from impl.cache import PagedCache
from impl.errors import PageAlreadyFree, PoolExhausted, ServingError
from impl.pool import pool_copies
from oracles.compare import compare

pytestmark = [pytest.mark.correctness, pytest.mark.builtin_only("pagecheck's own page pool, cache and scheduler")]


@pytest.mark.parametrize("L,dtype", [(1, mx.float32), (3, mx.float32), (9, mx.float32), (3, mx.bfloat16)])
def test_invariant_1_context_len_counts_written_positions(L, dtype):
    """Histories written in interleaved chunks, then one step of L new positions each
    through StepBatch: context_lens are the cache lengths, every position below a length
    holds what was written (nothing above does), and paged attention over the pool
    equals the oracles on the K/V read back from the pages."""
    pool = make_pool(num_pages=20, dtype=dtype)
    caches = [PagedCache(pool) for _ in range(4)]
    written = {(b, layer, kind): [] for b in range(4) for layer in range(2) for kind in (0, 1)}
    for i, (b, n) in enumerate([(0, 5), (2, 3), (1, 2), (2, 11), (3, 4), (0, 4)]):
        ks, vs = fill_cache(caches[b], n, seed=i)
        for layer in range(2):
            written[b, layer, 0].append(ks[layer])
            written[b, layer, 1].append(vs[layer])
    for c in caches:
        c.reserve(L)
    batch = StepBatch(caches, L)
    B, lens = len(caches), [c.length for c in caches]
    assert lens == [9 + L, 2 + L, 14 + L, 4 + L]
    assert batch.metadata.context_lens_host.tolist() == lens and batch.positions.tolist() == [n - L for n in lens]
    for b, c in enumerate(caches):
        row = batch.metadata.block_table_host[b]
        assert row[:len(c.pages)].tolist() == c.pages and (row[len(c.pages):] == -1).all()
    for layer in range(2):
        step = [rows(B * L, dtype=dtype, seed=[layer, kind]).reshape(B, L, 2, 8).transpose(0, 2, 1, 3)
                for kind in (0, 1)]
        batch.write(layer, *step)
        q = rows(B * L, kv_heads=4, dtype=dtype, seed=[layer, 2]).reshape(B, L, 4, 8).transpose(0, 2, 1, 3)
        out = batch.attend(layer, q)
        dense = [dense_kv(c, layer) for c in caches]
        for b in range(B):
            for kind in (0, 1):
                new = np.array(step[kind][b].astype(mx.float32)).transpose(1, 0, 2)
                assert np.array_equal(dense[b][kind], np.concatenate(written[b, layer, kind] + [new]))
        result = compare(out, (q, *dense_layout(dense, dtype)), {"scale": None, "mask": "causal", "window": None})
        assert not result.failures(), result.failures()
    assert_unused_nan(pool, *caches)


def test_invariant_3_page_owned_by_one_request_unless_shared():
    pool = make_pool()
    a, b = PagedCache(pool), PagedCache(pool)
    fill_cache(a, 6, seed=1)
    fill_cache(b, 5, seed=2)
    assert not set(a.pages) & set(b.pages)
    c = a.fork()
    d = c.fork()
    assert [pool.ref_count(p) for p in a.pages] == [3, 3]
    assert_ownership(pool, a, b, c, d)
    copies = 0
    for writer, n in ((c, 1), (a, 3), (d, 2), (b, 1)):  # d's tail is private by its turn
        others = [x for x in (a, b, c, d) if x is not writer]
        before = {id(x): [dense_kv(x, layer) for layer in range(2)] for x in others}
        copies += writer.length % 4 != 0 and pool.ref_count(writer.pages[-1]) > 1
        start = writer.length
        fill_cache(writer, n, seed=10 + n)
        assert pool.stats().pages_copied == copies
        assert_ownership(pool, a, b, c, d)
        assert all(pool.ref_count(p) == 1 for p in set(writer.slots(start, n) // 4))  # written pages: private
        for x in others:
            now = [dense_kv(x, layer) for layer in range(2)]
            assert all(np.array_equal(u, w) for old, new in zip(before[id(x)], now) for u, w in zip(old, new))
    assert copies == 2 and [pool.ref_count(p) for p in a.pages] == [3, 1, 1]
    for x in (a, b, c, d):
        assert len(set(x.pages)) == len(x.pages)
    assert_unused_nan(pool, a, b, c, d)


@pytest.mark.parametrize("order", [(0, 1, 2, 3), (3, 2, 1, 0), (1, 3, 0, 2)])
def test_invariant_4_release_returns_each_page_once(order):
    pool = make_pool(poison_freed=True)
    a = PagedCache(pool)
    fill_cache(a, 7, seed=1)
    b = a.fork()
    fill_cache(b, 3, seed=2)  # copies the shared tail
    c = PagedCache(pool)
    fill_cache(c, 4, seed=3)
    d = c.fork()
    caches = [a, b, c, d]
    held = set().union(*(x.pages for x in caches))
    returned = []
    for i in order:
        expect = [p for p in caches[i].pages if pool.ref_count(p) == 1]
        got = caches[i].release()
        assert got == expect
        returned += got
        assert_ownership(pool, *caches)
        for layer in range(2):
            for x in (pool.keys(layer), pool.values(layer)):
                assert np.isnan(np.array(x)[got]).all()
    assert sorted(returned) == sorted(held)
    refs, free, stats = pool.allocator.snapshot()
    assert sorted(free) == list(range(12)) and (stats.frees, stats.live) == (len(held), 0)
    before = pool_state(pool, *caches)
    for x in caches:
        with pytest.raises(PageAlreadyFree):
            x.release()
    assert_same_state(before, pool_state(pool, *caches))


@pytest.mark.parametrize("page_size", [1, 3, 4])
def test_invariant_5_new_page_only_when_tail_full(page_size):
    pool = make_pool(page_size=page_size, num_pages=24)
    cache = PagedCache(pool)
    for step, n in enumerate([1, 1, 2, 5, 1, 1, 3, 0, 4, 1]):
        old_pages, room, allocs = list(cache.pages), cache.tail_free_slots, pool.stats().allocations
        new = -(-max(n - room, 0) // page_size)
        assert cache.pages_needed(n) == new
        fill_cache(cache, n, seed=step)
        assert cache.pages[:len(old_pages)] == old_pages
        assert len(cache.pages) - len(old_pages) == pool.stats().allocations - allocs == new
        assert len(cache.pages) == -(-cache.length // page_size)
    assert_unused_nan(pool, cache)


def _world():
    """5 pages: d held page 0 and was released; a and its fork b share [0, 1] (6
    positions); c (max_tokens 8) holds [2, 3] (7 positions); page 4 is free."""
    pool = make_pool(num_pages=5)
    d = PagedCache(pool)
    fill_cache(d, 3)
    d.release()
    a, c = PagedCache(pool), PagedCache(pool, max_tokens=8)
    fill_cache(a, 6, seed=1)
    b = a.fork()
    fill_cache(c, 7, seed=2)
    assert (a.pages, c.pages, pool.stats().free) == ([0, 1], [2, 3], 1)
    return SimpleNamespace(pool=pool, a=a, b=b, c=c, d=d)


def _one(w, n=1, **kw):
    return pool_rows(w.pool, n, seed=99) if not kw else rows(n, **{"seed": 99, **kw})


def _foreign_slots(w):
    # A slot list checked against another pool whose allocator shows the same version:
    # it must be checked again here, where page 4 is free.
    other = make_pool(num_pages=w.pool.num_pages)
    other.allocate(5)
    return dataclasses.replace(other.prepare_slots([16]), version=w.pool.allocator.version)


MISUSES = {
    "double-free": (lambda w: w.pool.free([4]), "already_free"),
    "free-listed-twice": (lambda w: w.pool.free([3, 3]), "already_free"),
    "free-shared-thrice": (lambda w: w.pool.free([0, 0, 0]), "already_free"),
    "free-live-and-free": (lambda w: w.pool.free([2, 4]), "already_free"),
    "share-free-page": (lambda w: w.pool.share([1, 4]), "already_free"),
    "release-twice": (lambda w: w.d.release(), "already_free"),
    "write-free-page": (lambda w: w.pool.write(0, [16], _one(w), _one(w)), "slot"),
    "copy-into-free-page": (lambda w: w.pool.copy_pages([2], [4]), "slot"),
    "use-after-release": (lambda w: fill_cache(w.d, 1), "released"),
    "fork-after-release": (lambda w: w.d.fork(), "released"),
    **{f"free-foreign-{p!r}": (lambda w, p=p: w.pool.free([2, p]), "page_id") for p in (-1, 5, 1.5, True)},
    **{f"share-foreign-{p!r}": (lambda w, p=p: w.pool.share([p]), "page_id") for p in (-1, 5, 1.5, True)},
    "refcount-foreign": (lambda w: w.pool.ref_count(np.float64(1)), "page_id"),
    "append-heads": (lambda w: w.c.append([_one(w, kv_heads=1)] * 2, [_one(w, kv_heads=1)] * 2), "append_shape"),
    "append-layers": (lambda w: w.c.append([_one(w)], [_one(w)]), "append_shape"),
    "append-kv-lengths": (lambda w: w.c.append([_one(w)] * 2, [_one(w, 2)] * 2), "append_shape"),
    "append-dtype": (lambda w: w.c.append([_one(w, dtype=mx.float16)] * 2, [_one(w, dtype=mx.float16)] * 2),
                     "append_dtype"),
    "append-past-max-tokens": (lambda w: fill_cache(w.c, 2), "capacity"),
    "reserve-negative": (lambda w: w.a.reserve(-1), "append_shape"),
    "reserve-bool": (lambda w: w.a.reserve(True), "append_shape"),
    "write-shared-page": (lambda w: w.pool.write(0, [0], _one(w), _one(w)), "shared_write"),
    "write-shared-tail": (lambda w: w.pool.write(1, [11, 6], _one(w, 2), _one(w, 2)), "shared_write"),
    "layer-too-big": (lambda w: w.pool.write(2, [8], _one(w), _one(w)), "layer"),
    "layer-negative": (lambda w: w.pool.write(-1, [8], _one(w), _one(w)), "layer"),
    "layer-bool-read": (lambda w: w.pool.values(True), "layer"),
    "duplicate-slot": (lambda w: w.pool.write(0, [8, 15, 8], _one(w, 3), _one(w, 3)), "slot"),
    "slot-outside-pool": (lambda w: w.pool.write(0, [8, 20], _one(w, 2), _one(w, 2)), "slot"),
    "slot-negative": (lambda w: w.pool.write(0, [-1], _one(w), _one(w)), "slot"),
    "slot-float": (lambda w: w.pool.write(0, [8.0], _one(w), _one(w)), "slot"),
    "rows-per-slot": (lambda w: w.pool.write(0, [8, 9], _one(w), _one(w)), "append_shape"),
    "rows-dtype": (lambda w: w.pool.write(0, [8], _one(w), _one(w, dtype=mx.bfloat16)), "append_dtype"),
    "slots-not-reserved": (lambda w: w.a.slots(4, 3), "slot"),
    "allocate-too-many": (lambda w: w.pool.allocate(2), "pool_exhausted"),
    "copy-and-new-page": (lambda w: fill_cache(w.b, 3), "pool_exhausted"),
    "copy-into-shared-page": (lambda w: w.pool.copy_pages([2], [0]), "shared_write"),
    **{f"allocate-{n!r}": (lambda w, n=n: w.pool.allocate(n), "capacity") for n in (1.5, "2", None, True, -1)},
    "slots-from-another-pool": (lambda w: w.pool.write(0, _foreign_slots(w), _one(w), _one(w)), "slot"),
}
ERROR_CLASS = {"already_free": PageAlreadyFree, "pool_exhausted": PoolExhausted}


@pytest.mark.parametrize("name", list(MISUSES))
def test_invariant_10_bad_input_leaves_state_untouched(name):
    misuse, clause = MISUSES[name]
    w = _world()
    caches = (w.a, w.b, w.c, w.d)
    before, copies = pool_state(w.pool, *caches), pool_copies()
    with pytest.raises(ServingError) as e:
        misuse(w)
    assert type(e.value) is ERROR_CLASS.get(clause, ServingError) and e.value.clause == clause, e.value
    assert_same_state(before, pool_state(w.pool, *caches))
    assert pool_copies() == copies
    assert_ownership(w.pool, *caches)
    assert_unused_nan(w.pool, w.a, w.c)
