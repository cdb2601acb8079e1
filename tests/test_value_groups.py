"""A prefill's value pass weighs the rows that see the same keys of a chunk in groups of
kWeighRows = 6 (impl/csrc/value_pass.h weigh_by_group, value_loops.h weigh_rows): a choice of speed
only (every output element still adds p_j v_j in ascending j, one fused multiply-add
each), so the groups must really be of 6 where rows share their keys, and partial groups
of 1-5 rows must weigh every row. pagecheck_kernels.wide_value_rows counts the rows
weighed in full groups.

| what must hold                                                   | test                                   |
|------------------------------------------------------------------|----------------------------------------|
| a prefill behind a cached prefix weighs its rows in groups of 6  | test_rows_that_share_keys_go_six_at_once |
| (GQA group 4: every 6 rows span two positions' heads)            |                                        |
| a decode weighs none that way (its spans go 4 rows at a time)    | test_rows_that_share_keys_go_six_at_once |
| rows whose keys end at their own positions (the causal diagonal) | test_diagonal_rows_go_six_at_once_and_step_on |
| go 6 at a time too: the keys all see, then steps over the rest   |                                        |
| partial groups of 1-5 rows weigh every row: each prefill row     | test_partial_groups_weigh_every_row    |
| equals its one-token decode bit for bit (invariant 8; the decode |                                        |
| weighs span by span, never in these groups), f32 and bf16        |                                        |
"""

from __future__ import annotations

import pagecheck_kernels
import pytest

import impl
from fixtures import bits, paged_case
from tests.tile_path import tile_path

pytestmark = [pytest.mark.correctness, pytest.mark.builtin_only("the built-in kernel's prefill value groups")]


def test_rows_that_share_keys_go_six_at_once():
    # 64 positions behind 960 cached ones, GQA group 4: the chunks before the diagonal are
    # seen whole by all 256 rows of a KV head, 42 groups of 6 and one of 4 each; so are
    # the diagonal chunk's, whose keys end at their positions.
    case = paged_case(context_lens=[1024], query_len=64, q_heads=8, kv_heads=2, head_dim=64, page_size=16,
                      dtype="float32", seed=5)
    before = pagecheck_kernels.wide_value_rows()
    case.run(impl.paged_attention)
    assert pagecheck_kernels.wide_value_rows() - before == 2 * 4 * 42 * 6
    decode = paged_case(context_lens=[1024, 700], query_len=1, q_heads=8, kv_heads=2, head_dim=64, page_size=16,
                        dtype="float32", seed=6)
    before = pagecheck_kernels.wide_value_rows()
    decode.run(impl.paged_attention)
    assert pagecheck_kernels.wide_value_rows() == before


@pytest.mark.parametrize("q_heads, wide", [(4, 42 * 6), (1, 2 * 6)])
def test_diagonal_rows_go_six_at_once_and_step_on(q_heads, wide):
    # A prefill of 12 (G 1) or 64 (G 4) positions, no cached prefix: one chunk, every
    # position's keys end at a key of their own. Grouped by exact span, a group was one
    # position's G rows (never 6); in steps, the rows go 6 at a time over the keys all of
    # them see, then on over the rest; every row still equals its one-token decode.
    query_len = 64 if q_heads == 4 else 12
    case = paged_case(context_lens=[query_len], query_len=query_len, q_heads=q_heads, kv_heads=1, head_dim=64,
                      page_size=16, dtype="float32", seed=7)
    before = pagecheck_kernels.wide_value_rows()
    out = case.run(impl.paged_attention)
    assert pagecheck_kernels.wide_value_rows() - before == wide
    for row in range(query_len):
        assert bits(case.decode_row(row).run(impl.paged_attention)) == bits(out[:, :, row:row + 1]), f"row {row}"


# (q_heads, query_len): a KV head's rows that see whole chunks, G x L, leave 1-5 rows
# after the groups of 6: 13 -> 1, 20 -> 2, 27 -> 3, 52 -> 4, 65 -> 5
PARTIAL = [(1, 13), (2, 10), (3, 9), (4, 13), (5, 13)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("q_heads, query_len", PARTIAL)
def test_partial_groups_weigh_every_row(q_heads, query_len, dtype):
    case = paged_case(context_lens=[600], query_len=query_len, q_heads=q_heads, kv_heads=1, head_dim=64,
                      page_size=16, dtype=dtype, seed=q_heads)
    with tile_path(False):  # bfloat16 prefills take the value groups on the FMA path
        out = case.run(impl.paged_attention)
        for row in range(query_len):
            assert bits(case.decode_row(row).run(impl.paged_attention)) == bits(out[:, :, row:row + 1]), f"row {row}"
