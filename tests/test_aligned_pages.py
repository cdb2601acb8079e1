"""Page storage on cache lines (impl/csrc/aligned_array.h): MLX's own large buffers start
24 bytes into a 64-byte line, so every row of a pool did, and each 64-byte load of a
row spanned two lines (a float32 decode B 1 S 1024 ran 3% slower on such pages).
`aligned_full` makes impl.PagePool's pages, `aligned_copy` the benchmark's pools, in MLX
buffers (a buffer with a deleter of its own is never donated: every in-place write would
copy the pool); a pool copied by a write while the caller holds a layer stays on cache
lines too.

| what must hold                                                       | test                                          |
|----------------------------------------------------------------------|-----------------------------------------------|
| the copy starts on a line, keeps shape, dtype and every bit (strided | test_copy_starts_on_a_line_with_every_bit     |
| and lazy inputs too)                                                 |                                               |
| one MLX buffer a line longer, given back with its last holder       | test_buffer_lives_with_its_arrays             |
| an array of no elements: ValueError, nothing allocated               | test_no_elements_is_an_error                  |
| aligned_full: on a line, every element the value's bits, 5 dtypes   | test_full_starts_on_a_line_with_every_element |
| aligned_full of no elements or a value of several: ValueError,       | test_full_bad_inputs_allocate_nothing         |
| nothing allocated                                                    |                                               |
| a PagePool is built in its own storage: never a second layer held    | test_pool_is_built_without_a_second_layer     |
| a PagePool's pages start on lines, through in-place writes and the   | test_pool_pages_stay_on_lines                 |
| copy a held layer forces                                             |                                               |
| the benchmark's pools are allocated as the PagePool's                | test_benchmark_pools_start_on_lines           |
"""

from __future__ import annotations

import gc
import math

import mlx.core as mx
import numpy as np
import pagecheck_kernels
import pytest

from bench import grid, paths
from fixtures.serving import make_pool, pool_rows, raw
from impl.pool import pool_copies

pytestmark = [pytest.mark.correctness, pytest.mark.builtin_only("pagecheck's own page storage")]

LINE = 64
_WORDS = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32}


def address(x: mx.array) -> int:
    """Where x's data starts (through an unsigned view of the same buffer: numpy reads no
    bfloat16)."""
    mx.eval(x)
    return np.asarray(memoryview(x.view(_WORDS[x.dtype.size]))).ctypes.data


def active() -> int:
    gc.collect()
    return mx.get_active_memory()


def sources():
    """(name, array) inputs of every page dtype: plain, strided, lazy."""
    base = mx.random.normal((6, 2, 4, 40), key=mx.random.key(7))
    yield "float32", base
    yield "float16", base.astype(mx.float16)
    yield "bfloat16", base.astype(mx.bfloat16)
    yield "int8", (base * 40).astype(mx.int8)
    yield "uint8", (base * 40 + 128).astype(mx.uint8)
    yield "transposed", base.transpose(3, 1, 2, 0)
    yield "lazy", base * 2 + 1  # not evaluated before the copy


@pytest.mark.parametrize("name", [n for n, _ in sources()])
def test_copy_starts_on_a_line_with_every_bit(name):
    x = dict(sources())[name]
    y = pagecheck_kernels.aligned_copy(x)
    assert address(y) % LINE == 0
    assert (y.shape, y.dtype) == (x.shape, x.dtype)
    assert np.array_equal(raw(y), raw(x))


def test_buffer_lives_with_its_arrays():
    """One MLX buffer, a line longer than the data, held by the copy and whatever shares
    it (a slice), and given back with the last of them."""
    x = mx.arange(1 << 16, dtype=mx.float32)
    mx.eval(x)
    before = active()
    a = pagecheck_kernels.aligned_copy(x)
    part = a[1024:2048]
    mx.eval(part)
    assert active() - before == x.nbytes + LINE
    del a
    assert active() - before == x.nbytes + LINE  # the slice holds it still
    assert np.array_equal(np.array(part), np.arange(1024, 2048, dtype=np.float32))
    del part
    assert active() == before


def test_no_elements_is_an_error():
    before = active()
    with pytest.raises(ValueError, match="no elements"):
        pagecheck_kernels.aligned_copy(mx.zeros((0, 8)))
    assert active() == before


FULL = [(mx.float32, math.nan), (mx.float16, -2.5), (mx.bfloat16, math.nan), (mx.int8, -127), (mx.uint8, 0xFF)]


@pytest.mark.parametrize("dtype, value", FULL, ids=[str(d) for d, _ in FULL])
def test_full_starts_on_a_line_with_every_element(dtype, value):
    y = pagecheck_kernels.aligned_full((5, 3, 4, 24), mx.array(value, dtype=dtype))
    assert address(y) % LINE == 0
    assert (y.shape, y.dtype) == ((5, 3, 4, 24), dtype)
    assert np.array_equal(raw(y), raw(mx.full((5, 3, 4, 24), value, dtype=dtype)))


def test_full_bad_inputs_allocate_nothing():
    value = mx.array(1.0)
    mx.eval(value)
    before = active()
    with pytest.raises(ValueError, match="no elements"):
        pagecheck_kernels.aligned_full((4, 0, 8), value)
    with pytest.raises(ValueError, match="one element"):
        pagecheck_kernels.aligned_full((4, 8), mx.array([1.0, 2.0]))
    with pytest.raises(ValueError, match="negative"):
        pagecheck_kernels.aligned_full((4, -8), value)
    assert active() == before


def test_pool_is_built_without_a_second_layer():
    """The pool's storage is all its construction holds: its pages filled in their own
    buffers, never an mx.full of a layer copied (the peak held one layer more, and MLX's
    buffer cache kept it)."""
    gc.collect()
    mx.clear_cache()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    pool = make_pool(num_pages=4096, head_dim=64)
    layers = [pool.keys(0), pool.values(0), pool.keys(1), pool.values(1)]
    pages = sum(x.nbytes for x in layers)
    assert pages == 4 * 4096 * 2 * 4 * 64 * 4
    assert mx.get_peak_memory() - before <= pages + 4 * LINE + 4096  # the fill value, a few bytes
    assert mx.get_cache_memory() <= 4096


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_pool_pages_stay_on_lines(dtype):
    pool = make_pool(dtype=dtype)
    layers = [pool.keys(0), pool.values(0), pool.keys(1), pool.values(1)]
    assert [address(x) % LINE for x in layers] == [0] * 4
    where = address(pool.keys(0))
    del layers
    pool.allocate(2)
    copies = pool_copies()
    pool.write(0, [1, 5], pool_rows(pool, 2, seed=1), pool_rows(pool, 2, seed=2))  # in place
    assert (address(pool.keys(0)), pool_copies()) == (where, copies)
    held = pool.keys(0)
    pool.write(0, [2], pool_rows(pool, 1, seed=3), pool_rows(pool, 1, seed=4))  # held: copied
    now = address(pool.keys(0))
    assert (pool_copies(), now != address(held), now % LINE) == (copies + 1, True, 0)


def test_benchmark_pools_start_on_lines():
    spec = grid.Spec(op="decode", batch=1, context=32, page_size=16, dtype="float32", query_len=1)
    pools = paths.Pools([spec])
    for path in ("paged", "paged_fp8"):
        case = pools.case_for(spec, path)
        assert [address(case.key_pages) % LINE, address(case.value_pages) % LINE] == [0, 0], path
