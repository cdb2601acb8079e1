"""The kept buffer of large outputs (impl/csrc/output_cache.h): a call whose output has
the size of the last one that died takes its buffer instead of a new one, which Linux
would fault in and zero; every element is written again, so the bits are a new buffer's.

| stat | meaning |
|---|---|
| `reused` | outputs of 32-512 MiB given the kept buffer |
| `fresh` | outputs of that size given a new one |
| `held` | bytes kept now (one buffer at most) |
"""

from __future__ import annotations

import gc

import pytest

import impl
import impl.now
from fixtures import bits, paged_case
from impl import runtime

pytestmark = [pytest.mark.builtin_only("the built-in kernel's output buffers")]

MIB = 1 << 20
REQUESTS = 4096  # x 16 query heads x D 128 x 4 bytes = 32 MiB, the smallest size kept
ENTRIES = {"lazy": impl.paged_attention, "now": impl.now.paged_attention}


def big_case(*, seed, head_dim=128, empty=()):
    """One-token decodes of 3 keys each (a little work, a large output); `empty`: slots
    with no context, whose rows must come out as zeros."""
    lens = [0 if b in empty else 3 for b in range(REQUESTS)]
    return paged_case(context_lens=lens, query_len=1, q_heads=16, kv_heads=2, head_dim=head_dim, page_size=4,
                      seed=seed, extra_pages=0)


def output_bits(case, entry) -> bytes:
    """The call's output bytes; the output itself is dead (its buffer given back) on return."""
    out = case.run(entry)
    try:
        return bits(out)
    finally:
        del out
        gc.collect()


def stats_after(action) -> dict:
    """How `action()` moved the counts, and the bytes held after it."""
    before = runtime.output_cache_stats()
    action()
    after = runtime.output_cache_stats()
    return dict(reused=after["reused"] - before["reused"], fresh=after["fresh"] - before["fresh"],
                held=after["held"])


@pytest.fixture(autouse=True)
def nothing_kept():
    runtime.release_output_cache()
    yield
    runtime.release_output_cache()


@pytest.mark.parametrize("entry", ENTRIES)
def test_an_output_as_large_as_a_dead_one_takes_its_buffer_and_every_element_is_written(entry):
    fn = ENTRIES[entry]
    first, second = big_case(seed=1), big_case(seed=2, empty=range(0, REQUESTS, 3))
    seen = {}
    assert stats_after(lambda: seen.update(first=output_bits(first, fn))) == dict(reused=0, fresh=1, held=32 * MIB)
    assert stats_after(lambda: seen.update(reused=output_bits(second, fn))) == dict(reused=1, fresh=0,
                                                                                   held=32 * MIB)
    assert runtime.release_output_cache() == 32 * MIB
    assert stats_after(lambda: seen.update(new=output_bits(second, fn))) == dict(reused=0, fresh=1, held=32 * MIB)
    # The empty slots' zeros and every other row are the call's own, not the first call's.
    assert seen["reused"] == seen["new"] != seen["first"]


def test_a_call_of_another_size_frees_the_kept_buffer_and_keeps_its_own():
    fn = ENTRIES["now"]
    output_bits(big_case(seed=3), fn)
    assert runtime.output_cache_stats()["held"] == 32 * MIB
    wider = big_case(seed=4, head_dim=256)  # 64 MiB out
    held_during = []

    def call():
        out = wider.run(fn)
        held_during.append(runtime.output_cache_stats()["held"])
        del out
        gc.collect()
    assert stats_after(call) == dict(reused=0, fresh=1, held=64 * MIB)
    assert held_during == [0]  # the 32 MiB buffer was freed, not kept beside the new one
    assert runtime.release_output_cache() == 64 * MIB
    assert runtime.release_output_cache() == 0 and runtime.output_cache_stats()["held"] == 0


def test_small_outputs_are_left_to_mlx():
    small = paged_case(context_lens=[40, 7], query_len=3, q_heads=4, kv_heads=2, head_dim=64, page_size=8, seed=5)
    assert stats_after(lambda: output_bits(small, ENTRIES["now"])) == dict(reused=0, fresh=0, held=0)
