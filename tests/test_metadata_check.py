"""The compiled value check of the metadata (impl/csrc/metadata_check.h) that
`paged_attention` runs on every call, against a plain loop of the rules.

`paged_attention` reads the caller's `block_table` / `context_lens` where they lie (no
host copy: issue 22, point 4), so the check must read any MLX layout as the kernel will:
strided and transposed views, broadcast rows, arrays not yet evaluated."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import impl
import pagecheck_kernels
from fixtures import bits, paged_case
from impl.validation import METADATA_RULES, check_metadata_values

pytestmark = [pytest.mark.correctness,
              pytest.mark.builtin_only("the built-in's compiled metadata check and its clause ids")]


def reference_fault(table: np.ndarray, lens: np.ndarray, page_size: int, num_pages: int, query_len: int):
    """(rule, request, context, column, page) of REFERENCE.md section 1's rules, one
    request at a time: the first offending request, its first broken rule in clause
    order, for page_id its first bad column among those it reads."""
    max_pages = table.shape[1]
    for b, ctx in enumerate(int(c) for c in lens):
        for rule, broken in (("context_negative", ctx < 0), ("context_short", 0 < ctx < query_len),
                             ("table_short", ctx > max_pages * page_size)):
            if broken:
                return METADATA_RULES.index(rule), b, ctx, 0, 0
        for j in range(-(-ctx // page_size)):
            if not 0 <= int(table[b, j]) < num_pages:
                return METADATA_RULES.index("page_id"), b, ctx, j, int(table[b, j])
    return 0, 0, 0, 0, 0


# How the caller's arrays may lie: each gives MLX arrays holding exactly `table`, `lens`.
LAYOUTS = {
    "contiguous": lambda t, n: (mx.array(t), mx.array(n)),
    "column-strided": lambda t, n: (mx.array(np.repeat(t, 2, axis=1))[:, ::2], mx.array(np.repeat(n, 3))[::3]),
    "transposed": lambda t, n: (mx.array(np.ascontiguousarray(t.T)).T, mx.array(n[::-1].copy())[::-1]),
    "offset": lambda t, n: (mx.array(np.pad(t, ((1, 0), (2, 0)), constant_values=-9))[1:, 2:],
                            mx.array(np.pad(n, (3, 0), constant_values=-9))[3:]),
    "lazy": lambda t, n: (mx.array(t) + 0, mx.array(n) * 1),
}

ids = st.one_of(st.integers(-3, 12), st.sampled_from([-2 ** 31, 2 ** 31 - 1]))
contexts = st.one_of(st.integers(-2, 30), st.sampled_from([-2 ** 31, 2 ** 31 - 1]))


@st.composite
def metadata(draw):
    B, max_pages = draw(st.integers(0, 5)), draw(st.integers(0, 5))
    table = np.array(draw(st.lists(st.lists(ids, min_size=max_pages, max_size=max_pages), min_size=B, max_size=B)),
                     dtype=np.int32).reshape(B, max_pages)
    lens = np.array(draw(st.lists(contexts, min_size=B, max_size=B)), dtype=np.int32)
    return table, lens, draw(st.integers(1, 6)), draw(st.integers(0, 10)), draw(st.integers(1, 4))


@settings(max_examples=300, deadline=None)
@given(metadata(), st.sampled_from(sorted(LAYOUTS)))
def test_compiled_check_finds_the_fault_a_loop_finds(meta, layout):
    table, lens, page_size, num_pages, query_len = meta
    bt, cl = LAYOUTS[layout](table, lens)
    assert (np.array(bt).tolist(), np.array(cl).tolist()) == (table.tolist(), lens.tolist())
    expected = reference_fault(table, lens, page_size, num_pages, query_len)
    assert pagecheck_kernels.check_metadata(bt, cl, page_size, num_pages, query_len) == expected
    rule = METADATA_RULES[expected[0]]
    if rule is None:
        check_metadata_values(bt, cl, page_size=page_size, num_pages=num_pages, query_len=query_len)
    else:
        with pytest.raises(impl.ContractViolation) as e:
            check_metadata_values(bt, cl, page_size=page_size, num_pages=num_pages, query_len=query_len)
        _, b, ctx, j, page = expected
        names = {"context_negative": f"context_lens[{b}] = {ctx} is negative",
                 "context_short": f"context_lens[{b}] = {ctx} is shorter",
                 "table_short": f"request {b} needs {-(-ctx // page_size)} pages (context {ctx}",
                 "page_id": f"block_table[{b}, {j}] = {page} is outside the pool [0, {num_pages})"}
        assert e.value.clause == rule and str(e.value).startswith(names[rule])


# (table row, context, page_size 4, pool of 7 pages, L 3) -> the clause at each exact bound
BOUNDS = {
    "last-page-id": ([6, 6, 6], 12, None),
    "page-id-is-pool-size": ([6, 6, 7], 12, "page_id"),
    "page-id-minus-one": ([6, -1, 6], 12, "page_id"),
    "column-at-context-unread": ([6, 6, 99], 8, None),
    "last-column-read": ([6, 6, 99], 9, "page_id"),
    "context-fills-table": ([0, 1, 2], 12, None),
    "context-past-table": ([0, 1, 2], 13, "table_short"),
    "context-equals-l": ([0, -5, -5], 3, None),
    "context-below-l": ([0, -5, -5], 2, "context_short"),
    "empty-slot": ([-5, -5, -5], 0, None),
    "context-minus-one": ([0, 1, 2], -1, "context_negative"),
}


@pytest.mark.parametrize("name", sorted(BOUNDS))
def test_compiled_check_at_the_exact_bounds(name):
    row, ctx, clause = BOUNDS[name]
    table, lens = np.array([[0, 1, 2], row], np.int32), np.array([12, ctx], np.int32)
    fault = pagecheck_kernels.check_metadata(mx.array(table), mx.array(lens), 4, 7, 3)
    assert METADATA_RULES[fault[0]] == clause and fault == reference_fault(table, lens, 4, 7, 3)


BAD_CALLS = {
    "table-int64": (lambda t, n: (t.astype(mx.int64), n, 4), "metadata must be int32"),
    "lens-uint32": (lambda t, n: (t, n.astype(mx.uint32), 4), "metadata must be int32"),
    "table-rank": (lambda t, n: (t[0], n, 4), "block_table must be 2-D"),
    "lens-rank": (lambda t, n: (t, n[None], 4), "context_lens 1-D"),
    "rows": (lambda t, n: (t[:1], n, 4), "differ in rows"),
    "page-size": (lambda t, n: (t, n, 0), "page_size must be >= 1"),
}


@pytest.mark.parametrize("name", sorted(BAD_CALLS))
def test_unvalidated_check_rejects_what_it_cannot_read(name):
    make, message = BAD_CALLS[name]
    bt, cl, page_size = make(mx.array([[0, 1], [2, 3]], dtype=mx.int32), mx.array([5, 8], dtype=mx.int32))
    with pytest.raises(ValueError, match=f"check_metadata: .*{message}"):
        pagecheck_kernels.check_metadata(bt, cl, page_size, 4, 1)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_paged_attention_reads_metadata_in_any_layout(layout):
    case = paged_case(context_lens=[10, 3, 0], query_len=3, page_size=4, seed=7, max_pages=3)
    bt, cl = LAYOUTS[layout](np.array(case.block_table), np.array(case.context_lens))
    assert bits(case.with_(block_table=bt, context_lens=cl).run(impl.paged_attention)) == \
        bits(case.run(impl.paged_attention))


def test_paged_attention_computes_with_the_metadata_it_checked():
    """No copy is taken, yet an in-place update of the caller's arrays after the call
    (before its output is evaluated) cannot reach the kernel: MLX rebinds the updated
    object to a new array and the graph keeps the one checked."""
    case = paged_case(context_lens=[10, 3], query_len=3, page_size=4, seed=9, max_pages=3)
    expected = bits(case.run(impl.paged_attention))
    table, lens = mx.array(np.array(case.block_table)), mx.array(np.array(case.context_lens))
    out = impl.paged_attention(case.query, case.key_pages, case.value_pages, table, lens, case.page_size)
    table[0, 0] = 10 ** 6
    lens[1] = -1
    mx.eval(table, lens)
    assert bits(out) == expected
    with pytest.raises(impl.ContractViolation, match=r"block_table\[0, 0\] = 1000000 is outside the pool"):
        impl.paged_attention(case.query, case.key_pages, case.value_pages, table, lens, case.page_size)


def test_a_page_size_past_int64_capacity_is_not_a_short_table():
    """max_pages * page_size past int64 saturates: a valid request is accepted, as the
    exact product would say (PagedMetadata.build takes any page_size >= 1)."""
    table, lens = mx.array([[0, 1]], dtype=mx.int32), mx.array([5], dtype=mx.int32)
    assert pagecheck_kernels.check_metadata(table, lens, 2 ** 62, 4, 1) == (0, 0, 0, 0, 0)
    meta = impl.PagedMetadata.build(np.array(table), np.array(lens), page_size=2 ** 62, num_pages=4, query_len=1)
    assert meta.page_size == 2 ** 62
