"""What mutmut showed unpinned in the operator contract's validation
(`python -m mutants.mutmut_run`): each case below kills mutants of impl/validation.py
that survived the rest of the correctness suite: every rejection's clause and exact
message, metadata built from each kind of bad input, the frozen snapshot of what was
checked, `check_arrays`' whole geometry and the largest accepted options.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import impl
from impl.validation import Geometry, check_arrays, check_options
from tests.test_rejections import BAD, _base

pytestmark = [pytest.mark.correctness, pytest.mark.builtin_only("the built-in validation's exact messages")]


# -- operator contract ------------------------------------------------------------------
# test_rejections' cases (request 0: 10 positions in 3 pages of 4, request 1: 3; L = 3,
# Hq = 4, Hkv = 2, D = 8, 7 pages) and more; each with its clause and exact message.
MORE_BAD = {
    "keys-not-array": (lambda c: c.with_(key_pages=np.array(c.key_pages)), "type"),
    "values-not-array": (lambda c: c.with_(value_pages=np.array(c.value_pages)), "type"),
    "table-not-array": (lambda c: c.with_(block_table=np.array(c.block_table)), "type"),
    "lens-not-array": (lambda c: c.with_(context_lens=[10, 3]), "type"),
    "values-rank": (lambda c: c.with_(value_pages=c.value_pages[0]), "rank"),
    "page-size-bool": (lambda c: c.with_(page_size=True), "page_size"),
    "scale-bool": (lambda c: c.with_(scale=True), "scale"),
    "scale-past-float32": (lambda c: c.with_(scale=1e39), "scale"),
    "window-float": (lambda c: c.with_(window=2.0), "window"),
    "window-bool": (lambda c: c.with_(window=True), "window"),
    "window-past-int32": (lambda c: c.with_(window=2 ** 31), "window"),
}
REJECTIONS = {
    "query-not-array": "query must be an mlx.core.array, got ndarray",
    "keys-not-array": "key_pages must be an mlx.core.array, got ndarray",
    "values-not-array": "value_pages must be an mlx.core.array, got ndarray",
    "table-not-array": "block_table must be an mlx.core.array, got ndarray",
    "lens-not-array": "context_lens must be an mlx.core.array, got list",
    "query-rank": "query must be 4-D [B, Hq, L, D]; got shape (4, 3, 8)",
    "pool-rank": "key_pages must be 4-D [P, Hkv, page_size, Dk]; got shape (2, 4, 8)",
    "values-rank": "value_pages must be 4-D [P, Hkv, page_size, Dv]; got shape (2, 4, 8)",
    "table-rank": "block_table must be 2-D [B, max_pages]; got shape (3,)",
    "lens-rank": "context_lens must be 1-D [B]; got shape (1, 2)",
    "query-int": "query dtype int32 is not supported (float32, float16, bfloat16)",
    "query-f64": "query dtype float64 is not supported (float32, float16, bfloat16)",
    "keys-dtype": "key_pages dtype float16 differs from query dtype float32",
    "values-dtype": "value_pages dtype bfloat16 differs from query dtype float32",
    "table-int64": "block_table must be int32, got int64",
    "lens-uint32": "context_lens must be int32, got uint32",
    "values-shape": "value_pages shape (7, 2, 2, 8) differs from key_pages shape (7, 2, 4, 8) outside the head dim "
                    "([P, Hkv, page_size] must agree; only Dv may differ from Dk)",
    "head-dim": "head dim differs: query D=4, key_pages D=8",
    "table-rows": "block_table has 1 rows but query has B=2 requests",
    "lens-rows": "context_lens has 3 rows but query has B=2 requests",
    "gqa": "Hq=3 is not a multiple of Hkv=2",
    "page-size-pool": "page_size=8 disagrees with key_pages.shape[2]=4",
    "page-size-zero": "page_size must be >= 1, got 0",
    "page-size-float": "page_size must be an int, got float 4.0",
    "page-size-bool": "page_size must be an int, got bool True",
    "scale-nan": "scale must be a finite float32 value, got nan",
    "scale-str": "scale must be a float, got str '0.5'",
    "scale-bool": "scale must be a float, got bool True",
    "scale-past-float32": "scale must be a finite float32 value, got 1e+39",
    "mask": "mask must be 'causal' or None, got 'full'",
    "window-zero": "window must be >= 1 or None, got 0",
    "window-negative": "window must be >= 1 or None, got -2",
    "window-unmasked": "window=4 needs mask='causal' (got mask=None)",
    "window-float": "window must be an int, got float 2.0",
    "window-bool": "window must be an int, got bool True",
    "window-past-int32": "window=2147483648 does not fit in int32",
    "context-negative": "context_lens[1] = -1 is negative",
    "context-short": "context_lens[1] = 2 is shorter than the query length L=3: a non-empty request holds its L "
                     "new positions",
    "table-short": "request 0 needs 4 pages (context 13, page_size 4) but block_table rows hold max_pages=3",
    "page-id-high": "block_table[0, 2] = 999 is outside the pool [0, 7) (request 0 reads logical page 2)",
    "page-id-negative": "block_table[1, 0] = -1 is outside the pool [0, 7) (request 1 reads logical page 0)",
}


@pytest.mark.parametrize("name", list(REJECTIONS))
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # 1e39 vs float32 max
def test_rejections_say_exactly_what_was_wrong(name):
    mutate, clause = {**BAD, **MORE_BAD}[name][:2]
    with pytest.raises(impl.ContractViolation) as e:
        mutate(_base()).run(impl.paged_attention)
    assert (e.value.clause, str(e.value)) == (clause, REJECTIONS[name])


def _build(block_table=None, context_lens=None, page_size=4):
    base = _base()
    return impl.PagedMetadata.build(base.block_table if block_table is None else block_table,
                                    base.context_lens if context_lens is None else context_lens,
                                    page_size=page_size, num_pages=7, query_len=3)


TABLE, LENS = np.array(_base().block_table), np.array(_base().context_lens)
BAD_METADATA = {
    "table-mlx-int64": (lambda: _build(block_table=mx.array(TABLE).astype(mx.int64)), "metadata_dtype",
                        "block_table must be int32, got int64"),
    "lens-mlx-uint32": (lambda: _build(context_lens=mx.array(LENS).astype(mx.uint32)), "metadata_dtype",
                        "context_lens must be int32, got uint32"),
    "table-numpy-int64": (lambda: _build(block_table=TABLE.astype(np.int64)), "metadata_dtype",
                          "block_table must be int32, got int64"),
    "lens-numpy-int16": (lambda: _build(context_lens=LENS.astype(np.int16)), "metadata_dtype",
                         "context_lens must be int32, got int16"),
    "table-list": (lambda: _build(block_table=TABLE.tolist()), "type",
                   "block_table must be an mlx.core.array or numpy int32 array, got list"),
    "lens-list": (lambda: _build(context_lens=LENS.tolist()), "type",
                  "context_lens must be an mlx.core.array or numpy int32 array, got list"),
    "table-1d": (lambda: _build(block_table=TABLE[:, 0].copy()), "shape",
                 "block_table (2,) and context_lens (2,) must be [B, max_pages] and [B]"),
    "lens-2d": (lambda: _build(context_lens=LENS[:, None].copy()), "shape",
                "block_table (2, 3) and context_lens (2, 1) must be [B, max_pages] and [B]"),
    "rows-differ": (lambda: _build(block_table=TABLE[:1].copy()), "shape",
                    "block_table (1, 3) and context_lens (2,) must be [B, max_pages] and [B]"),
    "page-size-zero": (lambda: _build(page_size=0), "page_size", "page_size must be >= 1, got 0"),
    "page-size-float": (lambda: _build(page_size=4.0), "page_size", "page_size must be an int, got float 4.0"),
    "page-size-bool": (lambda: _build(page_size=True), "page_size", "page_size must be an int, got bool True"),
}


@pytest.mark.parametrize("name", list(BAD_METADATA))
def test_metadata_build_says_exactly_what_was_wrong(name):
    build, clause, message = BAD_METADATA[name]
    with pytest.raises(impl.ContractViolation) as e:
        build()
    assert (e.value.clause, str(e.value)) == (clause, message)


def test_metadata_is_a_frozen_snapshot_of_what_was_checked():
    """The host copies are taken, not views of the caller's arrays: an in-place change
    of those after `build` cannot reach the checked values, and neither copy is writable."""
    base = _base()
    table, lens = mx.array(TABLE), mx.array(LENS)
    meta = _build(block_table=table, context_lens=lens)
    table[0, 0] = 999
    lens[1] = -1
    mx.eval(table, lens)
    assert (meta.block_table_host.tolist(), meta.context_lens_host.tolist()) == (TABLE.tolist(), LENS.tolist())
    for host in (meta.block_table_host, meta.context_lens_host):
        with pytest.raises(ValueError):
            host[0] = 5
    out = impl.paged_attention_with_metadata(base.query, base.key_pages, base.value_pages, meta)
    assert np.array_equal(np.array(out), np.array(base.run(impl.paged_attention)))


def test_check_arrays_reads_the_whole_geometry():
    assert check_arrays(*_base().args()) == Geometry(batch=2, q_heads=4, kv_heads=2, query_len=3, head_dim=8,
                                                     num_pages=7, page_size=4, max_pages=3, value_dim=8)


def test_check_options_accepts_the_largest_values():
    """scale up to float32's largest finite value and window up to int32's largest."""
    f32, i32 = float(np.finfo(np.float32).max), int(np.iinfo(np.int32).max)
    assert check_options(16, -f32, "causal", i32) == (-f32, True, i32)
    assert check_options(16, None, None, None) == (0.25, False, 0)
