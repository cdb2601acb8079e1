"""The two kernel schedules and the edges of chunks, pages and windows."""

import mlx.core as mx
import numpy as np
import pytest

import impl
import pagecheck_kernels
from fixtures import bits, paged_case, to_numpy
from oracles.compare import compare

pytestmark = [pytest.mark.correctness, pytest.mark.builtin_only("the built-in kernel's decode/prefill schedules and chunk edges")]

CHUNK = pagecheck_kernels.CHUNK
THRESHOLD = pagecheck_kernels.DECODE_MAX_L


def test_threshold_is_where_the_issue_puts_it():
    assert THRESHOLD == 8 and CHUNK % pagecheck_kernels.LANES == 0


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_decode_and_prefill_schedules_agree_bitwise(dtype):
    """L = 8 runs the decode schedule, L = 9 the prefill one; rows at the same absolute
    positions must come out identical."""
    kwargs = dict(context_lens=[CHUNK + 9, 40], q_heads=8, kv_heads=2, head_dim=64, page_size=16,
                  dtype=dtype, seed=31)
    prefill = paged_case(query_len=THRESHOLD + 1, **kwargs)
    decode = prefill.with_(query=prefill.query[:, :, 1:])
    assert decode.query.shape[2] == THRESHOLD
    assert bits(decode.run(impl.paged_attention)) == bits(prefill.run(impl.paged_attention)[:, :, 1:])


@pytest.mark.parametrize("ctx", [CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK, 2 * CHUNK + 1])
@pytest.mark.parametrize("L,ps", [(1, 16), (9, 3), (3, 2 * CHUNK), (20, CHUNK)])
def test_chunk_and_page_edges(ctx, L, ps, error_log):
    """Contexts ending on either side of a chunk edge; pages smaller than, equal to and
    larger than a chunk (a chunk inside one page takes one table lookup)."""
    case = paged_case(context_lens=[ctx, L], query_len=L, q_heads=4, kv_heads=2, head_dim=64,
                      page_size=ps, seed=ctx + L)
    out = case.run(impl.paged_attention)
    result = compare(out, case.args(), case.kwargs())
    error_log.record(case.dtype, "float64", result.against_float64)
    assert not result.failures(), result.failures()


def test_window_one_returns_own_value_exactly():
    """Window 1: each query sees only itself, weight exactly 1, so out == V bit for bit."""
    case = paged_case(context_lens=[70], query_len=10, q_heads=2, kv_heads=1, head_dim=32,
                      page_size=8, window=1, seed=32)
    out = to_numpy(case.run(impl.paged_attention))
    table, vp = np.array(case.block_table), to_numpy(case.value_pages)
    for l in range(10):
        j = 60 + l
        own = vp[table[0, j // 8], 0, j % 8]
        assert np.array_equal(out[0, 0, l], own) and np.array_equal(out[0, 1, l], own)


@pytest.mark.parametrize("L", [1, 20])
def test_window_covering_the_context_equals_no_window(L):
    case = paged_case(context_lens=[300, 25], query_len=L, page_size=16, seed=33)
    assert bits(case.with_(window=300).run(impl.paged_attention)) == bits(case.run(impl.paged_attention))


@pytest.mark.parametrize("L", [1, 9])
def test_window_w_minus_one_w_w_plus_one_differ(L):
    """Off-by-one windows give different answers, and each matches the oracles."""
    outs = []
    for w in (15, 16, 17):
        case = paged_case(context_lens=[80], query_len=L, page_size=4, window=w, seed=34)
        out = case.run(impl.paged_attention)
        assert not compare(out, case.args(), case.kwargs()).failures()
        outs.append(to_numpy(out))
    assert np.abs(outs[0] - outs[1]).max() > 1e-3 and np.abs(outs[1] - outs[2]).max() > 1e-3


def test_no_window_no_mask_sees_everything():
    """mask=None: every row sees all context_lens keys, so rows differ only by query."""
    case = paged_case(context_lens=[33], query_len=4, mask=None, seed=35)
    same_q = case.with_(query=mx.broadcast_to(case.query[:, :, :1], case.query.shape))
    out = to_numpy(same_q.run(impl.paged_attention))
    assert all(np.array_equal(out[0, :, 0], out[0, :, l]) for l in range(4))


def test_all_slots_empty_gives_zeros_without_reading_the_pool():
    case = paged_case(context_lens=[0, 0], query_len=3, seed=36, extra_pages=2)
    out = to_numpy(case.run(impl.paged_attention))
    assert out.shape == (2, 4, 3, 16) and np.all(out == 0)


@pytest.mark.parametrize("L, starts", [(9, [0]), (64, [0]), (65, [64, 0]), (512, [448, 384, 320, 256, 192, 128, 64, 0])])
def test_prefill_hands_out_a_heads_blocks_last_first(L, starts):
    """The threads claim a prefill's blocks in order, and under a causal mask the last
    block sees the most keys: handed out last-first, a loop ends on short blocks instead
    of one thread finishing a long one alone (a choice of speed: bits are per row)."""
    assert pagecheck_kernels.prefill_block_starts(L) == starts


@pytest.mark.parametrize("L", [0, -64])
def test_prefill_block_starts_refuse_an_empty_query(L):
    with pytest.raises(ValueError, match="L must be at least 1"):
        pagecheck_kernels.prefill_block_starts(L)
