"""Layouts built to sit on the edges of the kernel's memory walk, each against the oracles.

An off-by-one in the walk reads the slot, page, table entry or buffer just past the data:
the NaN every unread slot holds shows up in the comparison, and under AddressSanitizer
(`python -m sanitize asan`) a read past the end of the pool or of the table buffer is a
report. So the cases put the data at the ends of the buffers:

| edge                         | how                                                            |
|------------------------------|----------------------------------------------------------------|
| last page of the pool        | the last request's tail page moved to physical page P-1, no free pages |
| first page of the pool       | the same page moved to physical page 0                        |
| table row exactly max_pages  | the last row of the table needs every one of its max_pages entries |
| page size 1                  | every key its own page, decode and prefill, across a chunk     |
| tails of 1 and page_size-1   | a context one slot into a fresh page / one short of a full one |
| tiles one past a page        | a 256-key chunk ending one slot into a page (256 % ps == 1); a 16-row prefill query block ending one row into a page |
| window one past a page       | a window whose first key is the last / the first slot of a page |
| a pool of one page           | P == 1, context 1 and a full page                              |
"""

import mlx.core as mx
import numpy as np
import pytest

import pagecheck_kernels
from fixtures import paged_case
from oracles.compare import compare

pytestmark = pytest.mark.correctness

CHUNK = pagecheck_kernels.CHUNK  # 256 keys
QUERY_BLOCK = 16  # prefill rows per work item (prefill.cpp kQueryBlock)

# name -> paged_case keyword arguments (seeded; the dtype and head dim rotate below)
EDGES = {
    "ps1-decode": dict(context_lens=[1, 7, 0], query_len=1, page_size=1),
    "ps1-decode-L8": dict(context_lens=[8, 13], query_len=8, page_size=1),
    "ps1-prefill": dict(context_lens=[40, 9], query_len=9, page_size=1),
    "ps1-across-chunk": dict(context_lens=[CHUNK + 1], query_len=1, page_size=1),
    "tail-1-decode": dict(context_lens=[3 * 16 + 1, 1], query_len=1, page_size=16),
    "tail-ps-1-decode": dict(context_lens=[3 * 16 + 15, 15], query_len=1, page_size=16),
    "tail-1-prefill": dict(context_lens=[2 * 16 + 1, 20], query_len=20, page_size=16),
    "tail-ps-1-prefill": dict(context_lens=[2 * 16 + 15, 31], query_len=20, page_size=16),
    "tail-1-ps3": dict(context_lens=[7, 4], query_len=4, page_size=3),
    "tail-ps-1-ps3": dict(context_lens=[8, 5], query_len=5, page_size=3),
    "row-exactly-max-pages-full": dict(context_lens=[5, 4 * 8], query_len=2, page_size=8, max_pages=4),
    "row-exactly-max-pages-tail-1": dict(context_lens=[5, 3 * 8 + 1], query_len=1, page_size=8, max_pages=4),
    "row-exactly-max-pages-prefill": dict(context_lens=[0, 4 * 8], query_len=12, page_size=8, max_pages=4),
    "chunk-one-past-page-ps85-decode": dict(context_lens=[CHUNK + 1, 3 * 85], query_len=1, page_size=85),
    "chunk-one-past-page-ps85-prefill": dict(context_lens=[CHUNK + 1 + 20], query_len=30, page_size=85),
    "chunk-one-past-page-ps255": dict(context_lens=[CHUNK + 1, 255], query_len=2, page_size=255),
    "chunk-one-past-page-ps15-prefill": dict(context_lens=[CHUNK + 15], query_len=17, page_size=15),
    "query-block-one-past-page": dict(context_lens=[QUERY_BLOCK + 1, 2 * QUERY_BLOCK + 1], query_len=17,
                                      page_size=QUERY_BLOCK),
    "query-block-one-past-page-ps8": dict(context_lens=[QUERY_BLOCK + 1, 0], query_len=QUERY_BLOCK + 1,
                                          page_size=8),
    "window-starts-last-slot": dict(context_lens=[40], query_len=1, page_size=8, window=9),
    "window-starts-first-slot-prefill": dict(context_lens=[41], query_len=10, page_size=8, window=8),
    "one-page-pool-full": dict(context_lens=[16], query_len=1, page_size=16, extra_pages=0),
    "one-page-pool-ctx-1": dict(context_lens=[1], query_len=1, page_size=16, extra_pages=0),
}

DTYPES = ("float32", "bfloat16", "float16")
HEAD_DIMS = (16, 24, 64)  # the vector path (D % 16 == 0) and the plain one


def _swap_pages(case, a: int, b: int):
    """The same layout with physical pages a and b exchanged (pools, table, free list)."""
    if a == b:
        return case
    perm = np.arange(case.key_pages.shape[0])
    perm[a], perm[b] = b, a  # old id -> new id, its own inverse
    table = np.array(case.block_table)
    table = np.where(table >= 0, perm[np.clip(table, 0, None)], table).astype(np.int32)
    index = mx.array(perm)
    return case.with_(key_pages=mx.take(case.key_pages, index, axis=0),
                      value_pages=mx.take(case.value_pages, index, axis=0), block_table=mx.array(table),
                      free_pages=tuple(int(perm[p]) for p in case.free_pages))


def _tail_page(case) -> int:
    """Physical page of the last non-empty request's last logical page."""
    lens = np.array(case.context_lens)
    b = int(np.flatnonzero(lens > 0)[-1])
    return int(np.array(case.block_table)[b, -(-int(lens[b]) // case.page_size) - 1])


def _case(name: str, i: int, placement: str):
    kwargs = dict(q_heads=4, kv_heads=2, head_dim=HEAD_DIMS[i % 3], dtype=DTYPES[(i + (placement != "random")) % 3],
                  seed=1000 + i, name=name, **EDGES[name])
    if placement != "random":
        kwargs["extra_pages"] = 0  # nothing after the data: the pool ends with the tail page
    case = paged_case(**kwargs)
    if placement == "tail-last-in-pool":
        case = _swap_pages(case, _tail_page(case), case.key_pages.shape[0] - 1)
    elif placement == "tail-first-in-pool":
        case = _swap_pages(case, _tail_page(case), 0)
    return case


@pytest.mark.clause("oracle", "addressing")
@pytest.mark.parametrize("placement", ["random", "tail-last-in-pool", "tail-first-in-pool"])
@pytest.mark.parametrize("i,name", list(enumerate(EDGES)), ids=list(EDGES))
def test_edge_matches_oracles(i, name, placement, attention, error_log):
    case = _case(name, i, placement)
    if placement == "tail-last-in-pool":
        assert _tail_page(case) == case.key_pages.shape[0] - 1
    out = case.run(attention)
    assert out.dtype == case.dtype and out.shape == case.query.shape
    result = compare(out, case.args(), case.kwargs())
    error_log.record(case.dtype, "float64", result.against_float64)
    assert not result.failures(), result.failures()


def test_full_row_is_the_last_row_of_the_table():
    """The row that needs all max_pages entries is the table's last: one entry further
    is past the end of the block_table buffer, not just into the next row."""
    case = _case("row-exactly-max-pages-full", 0, "random")
    table, lens = np.array(case.block_table), np.array(case.context_lens)
    assert table.shape == (2, 4) and -(-int(lens[-1]) // case.page_size) == table.shape[1]
    assert (table[-1] >= 0).all()


@pytest.mark.parametrize("name", [n for n in EDGES if n.startswith("chunk-one-past-page")])
def test_chunk_edge_lies_one_slot_into_a_page(name):
    """Guards the table above: these layouts put a chunk boundary one past a page edge."""
    ps = EDGES[name]["page_size"]
    assert CHUNK % ps == 1 and max(EDGES[name]["context_lens"]) > CHUNK
