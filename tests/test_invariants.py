"""Operator-level invariants of REFERENCE.md section 2, each a named test.

1 context_lens select exactly the written positions, 2 block table order, 3 shared
pages are only read, 6 batch invariance, 7 thread invariance, 8 prefill == decode,
9 unused slots never read (10 is in test_rejections; 3, 4, 5 and 10 at the pool and
cache level in test_serving_invariants; all ten through the scheduler in
test_scheduler_invariants). Bitwise ones compare raw bytes, not values.
"""

import mlx.core as mx
import numpy as np
import pytest

import os

from conformance.implementation import assert_same_output
from fixtures import bits, paged_case
from oracles.compare import compare
from oracles.tolerance import max_abs_error

pytestmark = pytest.mark.correctness


@pytest.fixture
def restore_threads(attention):
    if not attention.builtin:
        yield  # the loop below ends at the CPU count, a sane default for any kernel
        return
    import impl

    before = impl.num_threads()
    yield
    impl.set_num_threads(before)


def _table_with_pages_reversed(case, b):
    table = np.array(case.block_table)
    n = -(-int(np.array(case.context_lens)[b]) // case.page_size)
    table[b, :n] = table[b, :n][::-1].copy()
    return case.with_(block_table=mx.array(table))


@pytest.mark.clause("inv1")
@pytest.mark.parametrize("L", [1, 3])
def test_invariant_1_context_lens_select_exactly_the_written_positions(L, attention):
    """Positions 10 and 11 of the last page were never written (NaN): a context one too
    long reads one and turns NaN, one too short drops a key; the true one matches."""
    case = paged_case(context_lens=[10], query_len=L, page_size=4, seed=11)
    lens = lambda n: case.with_(context_lens=mx.array([n], dtype=mx.int32))  # noqa: E731
    out = case.run(attention)
    assert not compare(out, case.args(), case.kwargs()).failures()
    too_long = np.array(lens(11).run(attention))
    assert np.isnan(too_long[:, :, -1]).all() and np.isfinite(too_long[:, :, :-1]).all()  # only the last row sees slot 10
    short = lens(9)
    out_short = short.run(attention)
    assert not compare(out_short, short.args(), short.kwargs()).failures()
    assert max_abs_error(out_short, np.array(out)) > 1e-3


@pytest.mark.clause("inv3", "shared_pages")
def test_invariant_3_shared_pages_are_only_read(attention):
    """Two rows naming the same physical pages (a shared prefix) each see them whole,
    the twin rows agree bit for bit, and no pool bit changes."""
    base = paged_case(context_lens=[13, 13], query_len=2, page_size=4, seed=13)
    table = np.array(base.block_table)
    table[1] = table[0]
    shared = base.with_(block_table=mx.array(table), query=mx.concatenate([base.query[:1]] * 2))
    before = [bits(shared.key_pages), bits(shared.value_pages)]
    out = shared.run(attention)
    assert not compare(out, shared.args(), shared.kwargs()).failures()
    assert_same_output(attention, out[1:], out[:1], shared.with_(
        query=shared.query[:1], block_table=shared.block_table[:1], context_lens=shared.context_lens[:1]),
        "twin rows reading the same pages")
    assert [bits(shared.key_pages), bits(shared.value_pages)] == before


@pytest.mark.clause("inv2", "addressing")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_invariant_2_block_table_order(dtype, attention):
    """Reversing complete pages changes a causal prefill but not a one-token decode
    (each K/V pair moves with its page); either way the kernel follows the table."""
    prefill = paged_case(context_lens=[64], query_len=64, page_size=16, dtype=dtype, seed=21)
    swapped = _table_with_pages_reversed(prefill, 0)
    out, out_swapped = prefill.run(attention), swapped.run(attention)
    assert not compare(out_swapped, swapped.args(), swapped.kwargs()).failures()
    assert max_abs_error(out_swapped, np.array(out.astype(mx.float32))) > 1e-2

    decode = prefill.decode_row(63)
    decode_swapped = _table_with_pages_reversed(decode, 0)
    result = compare(decode_swapped.run(attention), decode.args(), decode.kwargs())
    assert not result.failures(), result.failures()


@pytest.mark.clause("inv6")
@pytest.mark.parametrize("L", [1, 5, 20])
def test_invariant_6_batch_invariance(L, attention):
    """A request's bits do not depend on its neighbours, its slot or the batch size."""
    attention.require("bitwise_batch")
    contexts = [300, L, 0, 40, 700]
    big = paged_case(context_lens=contexts, query_len=L, q_heads=8, kv_heads=2, head_dim=64,
                     page_size=16, seed=6)
    out = big.run(attention)
    for b, ctx in enumerate(contexts):
        alone = big.with_(query=big.query[b:b + 1], block_table=big.block_table[b:b + 1],
                          context_lens=big.context_lens[b:b + 1])
        assert bits(alone.run(attention)) == bits(out[b:b + 1]), f"request {b} (context {ctx})"
    order = [4, 0, 3]
    shuffled = big.with_(query=big.query[order], block_table=big.block_table[order],
                         context_lens=big.context_lens[order])
    assert bits(shuffled.run(attention)) == bits(out[order])


@pytest.mark.clause("inv7")
@pytest.mark.parametrize("L", [1, 7, 33])
def test_invariant_7_thread_invariance(L, attention, restore_threads):
    attention.require("bitwise_threads")
    case = paged_case(context_lens=[1100, 2 * L, 513], query_len=L, q_heads=8, kv_heads=2,
                      head_dim=64, page_size=16, window=300, seed=7)
    results = set()
    for n in (1, 2, 3, 5, os.cpu_count() or 1):
        attention.set_num_threads(n)
        results.add(bits(case.run(attention)))
    assert len(results) == 1, f"{len(results)} different outputs over worker counts 1, 2, 3, 5"


@pytest.mark.clause("inv8")
@pytest.mark.parametrize("mask,window,dtype", [("causal", None, "float32"), ("causal", 100, "float32"),
                                               ("causal", None, "bfloat16"), (None, None, "float16")])
def test_invariant_8_prefill_equals_decode(mask, window, dtype, attention):
    """Every row of a prefill equals the one-token decode at its position, bit for bit,
    across chunk boundaries (positions 255 / 256 / 511 / 512)."""
    attention.require("bitwise_batch")
    n = 530
    prefill = paged_case(context_lens=[n, 0], query_len=n, q_heads=4, kv_heads=2, head_dim=64,
                         page_size=16, mask=mask, window=window, dtype=dtype, seed=8)
    out = prefill.run(attention)
    rows = [0, 1, 15, 16, 255, 256, 257, 511, 512, n - 1] if mask else [n - 1]
    for l in rows:
        decode = prefill.decode_row(l)
        assert bits(decode.run(attention)) == bits(out[:, :, l:l + 1]), f"row {l}"


@pytest.mark.parametrize("L", [1, 12])
@pytest.mark.parametrize("fill", [0.0, 1e30, -np.inf])
@pytest.mark.clause("inv9")
def test_invariant_9_unused_slots_never_read(L, fill, attention):
    """NaN, huge or infinite garbage in tail slots and free pages changes no bit."""
    kwargs = dict(context_lens=[45, 0, 17], query_len=L, q_heads=4, kv_heads=1, head_dim=32,
                  page_size=8, seed=9)
    poisoned = paged_case(**kwargs)  # NaN
    assert_same_output(attention, paged_case(**kwargs, fill=fill).run(attention), poisoned.run(attention),
                       poisoned, f"unused slots holding NaN vs {fill}")
