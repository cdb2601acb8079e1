"""PagedCache: reserve / append across pages, slots, fork and copy-on-write, release,
max_tokens and an exhausted pool. Every check compares the whole state."""

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from fixtures.serving import (assert_ownership, assert_same_state, assert_unused_nan, changed_slots,
                              dense_kv, fill_cache, make_pool, pool_rows, pool_state)
from impl.cache import PagedCache
from impl.errors import PageAlreadyFree, PoolExhausted, ServingError

pytestmark = [pytest.mark.correctness, pytest.mark.builtin_only("pagecheck's own page pool, cache and scheduler")]


def _forked(n, **pool_overrides):
    """A parent holding n written positions and a fork of it."""
    pool = make_pool(**pool_overrides)
    parent = PagedCache(pool)
    written = fill_cache(parent, n, seed=1)
    return pool, parent, parent.fork(), written


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_prefill_chunks_span_interleaved_pages(dtype):
    pool = make_pool(dtype=dtype)
    a, b = PagedCache(pool), PagedCache(pool)
    ka, va = fill_cache(a, 5, seed=1)
    kb, vb = fill_cache(b, 3, seed=2)
    ka2, va2 = fill_cache(a, 6, seed=3)  # fills a's tail page, then takes page 3
    assert (a.pages, a.length, a.tail_free_slots) == ([0, 1, 3], 11, 1)
    assert (b.pages, b.length, b.tail_free_slots) == ([2], 3, 1)
    assert list(a.slots(5, 6)) == [5, 6, 7, 12, 13, 14]
    for layer in range(2):
        assert all(np.array_equal(x, y) for x, y in zip(dense_kv(a, layer), (
            np.concatenate([ka[layer], ka2[layer]]), np.concatenate([va[layer], va2[layer]]))))
        assert all(np.array_equal(x, y) for x, y in zip(dense_kv(b, layer), (kb[layer], vb[layer])))
    assert_ownership(pool, a, b)
    assert_unused_nan(pool, a, b)
    assert pool.stats().allocations == 4


def test_reserve_returns_slots_and_writes_nothing():
    pool = make_pool()
    cache = PagedCache(pool)
    fill_cache(cache, 3)
    before = pool_state(pool, cache)
    slots = cache.reserve(6)
    assert list(slots) == [3, 4, 5, 6, 7, 8] and (cache.pages, cache.length) == ([0, 1, 2], 9)
    assert list(cache.slots(0, 9)) == list(range(9)) and list(cache.slots(9, 0)) == []
    after = pool_state(pool, cache)
    assert not changed_slots(before, after) and after.allocator[2].allocations == 3
    with pytest.raises(ServingError) as e:
        cache.slots(7, 3)
    assert e.value.clause == "slot"


def test_fork_shares_every_page():
    pool, parent, child, _ = _forked(6)
    assert (child.pages, child.length, child.max_tokens) == (parent.pages, parent.length, parent.max_tokens)
    assert [pool.ref_count(p) for p in range(4)] == [2, 2, 0, 0]
    assert pool.stats().allocations == 2 and pool.stats().live == 2
    assert_ownership(pool, parent, child)
    assert all(np.array_equal(x, y) for layer in range(2)
               for x, y in zip(dense_kv(parent, layer), dense_kv(child, layer)))


@pytest.mark.parametrize("writer", ["child", "parent"])
def test_copy_on_write_of_a_shared_partial_tail(writer):
    pool, parent, child, _ = _forked(6)  # pages [0, 1]; page 1 holds 2 of 4
    w, other = (child, parent) if writer == "child" else (parent, child)
    other_before = [dense_kv(other, layer) for layer in range(2)]
    before = pool_state(pool, other)
    w.reserve(1)  # the copy only; nothing written yet
    assert (w.pages, other.pages, w.length) == ([0, 2], [0, 1], 7)
    mid = pool_state(pool, other)
    assert mid.caches == before.caches and mid.allocator[2].pages_copied == 1
    assert changed_slots(before, mid) == {(k, layer, s) for k in ("keys", "values")
                                          for layer in range(2) for s in (8, 9)}  # NaN tail copied onto NaN
    for bits in mid.keys + mid.values:
        assert np.array_equal(bits[2], bits[1])  # written slots and NaN tail alike
    new = [pool_rows(pool, 1, seed=40 + layer) for layer in range(2)]
    for layer in range(2):
        pool.write(layer, w.slots(6, 1), new[layer], new[layer])
    assert [pool.ref_count(p) for p in range(4)] == [2, 1, 1, 0]
    assert_ownership(pool, parent, child)
    for layer in range(2):
        assert all(np.array_equal(x, y) for x, y in zip(dense_kv(other, layer), other_before[layer]))
        k, v = dense_kv(w, layer)
        assert np.array_equal(k[:6], other_before[layer][0]) and np.array_equal(k[6], np.array(new[layer][0]))
    assert_unused_nan(pool, parent, child)


def test_full_shared_tail_needs_no_copy():
    pool, parent, child, _ = _forked(8)
    fill_cache(child, 1, seed=5)
    assert (parent.pages, child.pages) == ([0, 1], [0, 1, 2])
    assert [pool.ref_count(p) for p in range(3)] == [2, 2, 1] and pool.stats().pages_copied == 0
    assert_ownership(pool, parent, child)
    assert_unused_nan(pool, parent, child)


def test_release_returns_every_page_once():
    pool, parent, child, _ = _forked(6)
    fill_cache(child, 5, seed=2)  # copy of the shared tail page 1, plus one new page
    other = PagedCache(pool)
    fill_cache(other, 2, seed=3)
    assert (parent.pages, child.pages[0], sorted(child.pages[1:]), other.pages) == ([0, 1], 0, [2, 3], [4])
    private = child.pages[1:]
    stats = pool.stats()
    assert child.release() == private and (child.pages, child.length, child.released) == ([], 0, True)
    assert pool.stats() == replace(stats, live=3, free=9, frees=2)
    assert_ownership(pool, parent, child, other)
    assert parent.release() == [0, 1] and other.release() == [4]
    refs, free, end = pool.allocator.snapshot()
    assert refs == (0,) * 12 and sorted(free) == list(range(12)) and free[-5:] == (*private, 0, 1, 4)
    assert end == replace(stats, live=0, free=12, frees=5)


def test_release_twice_raises_and_changes_nothing():
    pool, parent, child, _ = _forked(6)
    child.release()
    before = pool_state(pool, parent, child)
    with pytest.raises(PageAlreadyFree) as e:
        child.release()
    assert e.value.clause == "already_free"
    assert_same_state(before, pool_state(pool, parent, child))
    assert [pool.ref_count(p) for p in parent.pages] == [1, 1]


@pytest.mark.parametrize("use", [lambda c: c.reserve(1), lambda c: fill_cache(c, 1), lambda c: c.fork(),
                                 lambda c: c.pages_needed(1), lambda c: c.reserve(0)],
                         ids=["reserve", "append", "fork", "pages_needed", "reserve-0"])
def test_use_after_release(use):
    pool, parent, child, _ = _forked(6)
    child.release()
    before = pool_state(pool, parent, child)
    with pytest.raises(ServingError) as e:
        use(child)
    assert type(e.value) is ServingError and e.value.clause == "released"
    assert_same_state(before, pool_state(pool, parent, child))


def test_max_tokens():
    pool = make_pool()
    cache = PagedCache(pool, max_tokens=6)
    fill_cache(cache, 4)
    for n in (3, 7):
        before = pool_state(pool, cache)
        with pytest.raises(ServingError) as e:
            fill_cache(cache, n)
        assert type(e.value) is ServingError and e.value.clause == "capacity"
        assert_same_state(before, pool_state(pool, cache))
    fill_cache(cache, 2)
    assert (cache.pages, cache.length) == ([0, 1], 6)
    with pytest.raises(ServingError, match="max_tokens=6"):
        cache.reserve(1)
    for bad in (-1, 2.0, "8"):
        with pytest.raises(ServingError) as e:
            PagedCache(pool, max_tokens=bad)
        assert e.value.clause == "capacity"


@pytest.mark.parametrize("n,needed", [(2, 1), (3, 2), (7, 3)])
def test_pool_exhausted_midway_changes_nothing(n, needed):
    """3 pages: parent and child share [0, 1] (tail half full), one page free. Writing
    2 more positions needs only the copy; 3 need the copy and a new page."""
    pool, parent, child, _ = _forked(6, num_pages=3)
    assert child.pages_needed(n) == needed
    before = pool_state(pool, parent, child)
    if needed == 1:
        fill_cache(child, n, seed=9)
        assert (child.pages, pool.stats().free, pool.stats().pages_copied) == ([0, 2], 0, 1)
        return
    with pytest.raises(PoolExhausted) as e:
        fill_cache(child, n, seed=9)
    assert e.value.clause == "pool_exhausted"
    assert_same_state(before, pool_state(pool, parent, child))
