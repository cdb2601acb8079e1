"""How the decode schedule cuts a call into work items (impl/csrc/decode.cpp): by
(request, chunk), each item a run of KV heads. Heads are split while there would be
fewer items than threads, or fewer than four per thread while an item keeps at least
1024 keys x query positions: smaller items cost more to set up than they gain in balance.
The bits never depend on it (test_invariants: worker counts); this pins the cut.
"""

import pytest

import pagecheck_kernels
from impl import runtime

pytestmark = pytest.mark.builtin_only("the built-in kernel's decode work items")

HKV = 8


@pytest.fixture
def threads():
    before = runtime.num_threads()

    def use(n):
        runtime.set_num_threads(n)
    yield use
    runtime.set_num_threads(before)


# (chunk items, keys per item, query positions) -> heads per item on 2 threads
TWO_THREADS = {
    "B1 S128: one per thread": ((1, 128, 1), 4),
    "B4 S128: items of 1024 keys x heads kept whole": ((4, 128, 1), 8),
    "B1 S1024: four per thread": ((4, 256, 1), 4),
    "B16 S128: enough items": ((16, 128, 1), 8),
    "B1 S8192: enough chunks": ((32, 256, 1), 8),
    "B1 S128 L4: rows weigh too": ((1, 128, 4), 2),
    "B1 S16: tiny, still one per thread": ((1, 16, 1), 4),
}


@pytest.mark.parametrize("name", TWO_THREADS)
def test_heads_per_item_on_two_threads(name, threads):
    threads(2)
    (items, keys, L), heads = TWO_THREADS[name]
    assert pagecheck_kernels.decode_heads_per_item(items, HKV, keys, L) == heads


def test_one_thread_keeps_items_whole_unless_they_are_large(threads):
    threads(1)
    assert pagecheck_kernels.decode_heads_per_item(1, HKV, 128, 1) == HKV
    assert pagecheck_kernels.decode_heads_per_item(1, HKV, 256, 1) == 4  # 4 x 256 keys is still 1024


def test_many_threads_split_down_to_single_heads(threads):
    threads(16)
    assert pagecheck_kernels.decode_heads_per_item(1, HKV, 128, 1) == 1
    assert pagecheck_kernels.decode_heads_per_item(1, 1, 128, 1) == 1
