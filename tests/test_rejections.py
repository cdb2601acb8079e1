"""Every rejection of REFERENCE.md section 1: a specific error naming the offender, raised
before anything is computed; pool and metadata keep every bit.

The built-in implementation must raise `ContractViolation` with the clause id and the
message below; another implementation (`--impl`) one of its declared `error_types`
(default ValueError or TypeError) with a non-empty message. The checks of prevalidated
metadata and of the unvalidated compiled entry point are the built-in's own."""

import mlx.core as mx
import numpy as np
import pytest

import impl
import pagecheck_kernels
from conformance.implementation import assert_same_output
from fixtures import bits, paged_case

pytestmark = pytest.mark.correctness


def _base(context_lens=(10, 3)):
    # request 0: 10 positions in 3 pages of 4; request 1: 3 positions in 1 page
    return paged_case(context_lens=list(context_lens), query_len=3, q_heads=4, kv_heads=2, head_dim=8,
                      page_size=4, seed=41, max_pages=3)


def _table(case, b, i, value):
    t = np.array(case.block_table)
    t[b, i] = value
    return mx.array(t)


BAD = {
    "query-not-array": (lambda c: c.with_(query=np.array(c.query)), "type", r"query must be an mlx.core.array"),
    "query-rank": (lambda c: c.with_(query=c.query[0]), "rank", r"query must be 4-D"),
    "pool-rank": (lambda c: c.with_(key_pages=c.key_pages[0]), "rank", r"key_pages must be 4-D"),
    "table-rank": (lambda c: c.with_(block_table=c.block_table[0]), "rank", r"block_table must be 2-D"),
    "lens-rank": (lambda c: c.with_(context_lens=c.context_lens[None]), "rank", r"context_lens must be 1-D"),
    "query-int": (lambda c: c.with_(query=c.query.astype(mx.int32)), "dtype", r"query dtype int32 is not supported"),
    "query-f64": (lambda c: c.with_(query=c.query.astype(mx.float64)), "dtype", r"float64 is not supported"),
    "keys-dtype": (lambda c: c.with_(key_pages=c.key_pages.astype(mx.float16)), "dtype",
                   r"key_pages dtype float16 differs from query dtype float32"),
    "values-dtype": (lambda c: c.with_(value_pages=c.value_pages.astype(mx.bfloat16)), "dtype",
                     r"value_pages dtype bfloat16 differs"),
    "table-int64": (lambda c: c.with_(block_table=c.block_table.astype(mx.int64)), "metadata_dtype",
                    r"block_table must be int32, got int64"),
    "lens-uint32": (lambda c: c.with_(context_lens=c.context_lens.astype(mx.uint32)), "metadata_dtype",
                    r"context_lens must be int32, got uint32"),
    "values-shape": (lambda c: c.with_(value_pages=c.value_pages[:, :, :2]), "value_shape",
                     r"value_pages shape .* differs from key_pages shape .* outside the head dim"),
    "values-heads": (lambda c: c.with_(value_pages=c.value_pages[:, :1]), "value_shape",
                     r"value_pages shape \(7, 1, 4, 8\) differs"),
    "head-dim": (lambda c: c.with_(query=c.query[..., :4]), "shape", r"head dim differs: query D=4, key_pages D=8"),
    "table-rows": (lambda c: c.with_(block_table=c.block_table[:1]), "shape", r"block_table has 1 rows but query has B=2"),
    "lens-rows": (lambda c: c.with_(context_lens=mx.array([10, 3, 0], dtype=mx.int32)), "shape",
                  r"context_lens has 3 rows"),
    "gqa": (lambda c: c.with_(query=c.query[:, :3]), "heads", r"Hq=3 is not a multiple of Hkv=2"),
    "page-size-pool": (lambda c: c.with_(page_size=8), "page_size", r"page_size=8 disagrees with key_pages.shape\[2\]=4"),
    "page-size-zero": (lambda c: c.with_(page_size=0), "page_size", r"page_size must be >= 1, got 0"),
    "page-size-float": (lambda c: c.with_(page_size=4.0), "page_size", r"page_size must be an int"),
    "scale-nan": (lambda c: c.with_(scale=float("nan")), "scale", r"scale must be a finite"),
    "scale-str": (lambda c: c.with_(scale="0.5"), "scale", r"scale must be a float"),
    "mask": (lambda c: c.with_(mask="full"), "mask", r"mask must be 'causal' or None, got 'full'"),
    "window-zero": (lambda c: c.with_(window=0), "window", r"window must be >= 1 or None, got 0"),
    "window-negative": (lambda c: c.with_(window=-2), "window", r"window must be >= 1"),
    "window-unmasked": (lambda c: c.with_(mask=None, window=4), "window", r"window=4 needs mask='causal'"),
    # contract v2 (REFERENCE.md 1b): checked only where the feature is declared
    "softcap-zero": (lambda c: c.with_(softcap=0.0), "softcap", r"softcap must be a finite float32 value > 0, got 0.0"),
    "softcap-negative": (lambda c: c.with_(softcap=-30.0), "softcap", r"softcap must be .* > 0, got -30.0"),
    "softcap-inf": (lambda c: c.with_(softcap=float("inf")), "softcap", r"softcap must be a finite"),
    "softcap-str": (lambda c: c.with_(softcap="30"), "softcap", r"softcap must be a float > 0 or None, got str"),
    "alibi-shape": (lambda c: c.with_(alibi_slopes=mx.ones((2,))), "alibi_slopes",
                    r"alibi_slopes must have shape \[Hq\] = \(4,\), got \(2,\)"),
    "alibi-dtype": (lambda c: c.with_(alibi_slopes=mx.ones((4,), dtype=mx.float16)), "alibi_slopes",
                    r"alibi_slopes must be float32, got float16"),
    "alibi-list": (lambda c: c.with_(alibi_slopes=[0.5] * 4), "alibi_slopes", r"alibi_slopes must be an mlx.core.array"),
    "sinks-shape": (lambda c: c.with_(sinks=mx.zeros((4, 1))), "sinks", r"sinks must have shape \[Hq\]"),
    "sinks-dtype": (lambda c: c.with_(sinks=mx.zeros((4,), dtype=mx.bfloat16)), "sinks",
                    r"sinks must be float32, got bfloat16"),
    "lse-not-bool": (lambda c: c.with_(return_lse="yes"), "lse", r"return_lse must be True or False, got 'yes'"),
    "context-negative": (lambda c: c.with_(context_lens=mx.array([10, -1], dtype=mx.int32)),
                         "context_negative", r"context_lens\[1\] = -1 is negative"),
    "context-short": (lambda c: c.with_(context_lens=mx.array([10, 2], dtype=mx.int32)), "context_short",
                      r"context_lens\[1\] = 2 is shorter than the query length L=3"),
    "table-short": (lambda c: c.with_(context_lens=mx.array([13, 3], dtype=mx.int32)), "table_short",
                    r"request 0 needs 4 pages \(context 13, page_size 4\) but block_table rows hold max_pages=3"),
    "page-id-high": (lambda c: c.with_(block_table=_table(c, 0, 2, 999)), "page_id",
                     r"block_table\[0, 2\] = 999 is outside the pool \[0, 7\) \(request 0 reads logical page 2\)"),
    "page-id-negative": (lambda c: c.with_(block_table=_table(c, 1, 0, -1)), "page_id",
                         r"block_table\[1, 0\] = -1 is outside the pool"),
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.clause("inv10", f"reject.{BAD[n][1]}"))
                                  for n in sorted(BAD)])
def test_invariant_10_rejection_leaves_inputs_and_outputs_untouched(name, attention):
    """Operator level of invariant 10 (pool and cache misuse: test_serving_invariants)."""
    attention.require("validates_input")
    mutate, clause, message = BAD[name]
    base = _base()
    earlier = base.run(attention)
    case = mutate(base)
    for feature in case.pipeline.features():  # a kernel without sinks is never failed for them
        attention.require(feature)
    state = (base.query, base.key_pages, base.value_pages, base.block_table, base.context_lens, earlier)
    before = [bits(a) for a in state]
    if attention.builtin:
        with pytest.raises(impl.ContractViolation, match=message) as info:
            case.run(attention.fn)
        assert info.value.clause == clause
        assert isinstance(info.value, ValueError)
    else:
        try:
            out = case.run(attention.fn)
        except attention.caps.error_types as e:
            assert str(e).strip(), f"{type(e).__name__} raised with an empty message"
        except Exception as e:
            pytest.fail(f"{name}: raised {type(e).__name__} ({e}), not one of the declared error types "
                        f"{[t.__name__ for t in attention.caps.error_types]}")
        else:
            pytest.fail(f"{name}: accepted (returned {getattr(out, 'shape', out)}); the contract rejects it "
                        f"(expected like: {message})")
    assert [bits(a) for a in state] == before, "a rejected call changed its inputs or an earlier output"


@pytest.mark.clause("inv9")
def test_unread_table_entries_are_ignored(attention):
    """Entries past ceil(ctx / page_size) may hold anything (convention: -1)."""
    base = _base()
    t = np.array(base.block_table)
    t[1, 1:] = [12345, -7]
    assert_same_output(attention, base.with_(block_table=mx.array(t)).run(attention), base.run(attention), base,
                       "garbage in unread table entries")


@pytest.mark.builtin_only("prevalidated metadata and the unvalidated compiled entry point")
def test_prevalidated_metadata_is_reused_without_value_checks():
    base = _base()
    meta = impl.PagedMetadata.build(np.array(base.block_table), np.array(base.context_lens), page_size=4,
                                    num_pages=base.key_pages.shape[0], query_len=3)
    out = impl.paged_attention_with_metadata(base.query, base.key_pages, base.value_pages, meta)
    assert bits(out) == bits(base.run(impl.paged_attention))
    with pytest.raises(ValueError):
        meta.block_table_host[0, 0] = 5  # the validated host copy is frozen


@pytest.mark.builtin_only("prevalidated metadata and the unvalidated compiled entry point")
@pytest.mark.parametrize("change,message", [
    (lambda c: c.with_(query=c.query[:, :, :2]), r"validated for \(B, L, P, page_size\) = \(2, 3, 7, 4\)"),
    (lambda c: c.with_(key_pages=c.key_pages[:5], value_pages=c.value_pages[:5]), r"this call has \(2, 3, 5, 4\)"),
])
def test_stale_metadata_is_rejected(change, message):
    base = _base()
    meta = impl.PagedMetadata.build(base.block_table, base.context_lens, page_size=4,
                                    num_pages=base.key_pages.shape[0], query_len=3)
    stale = change(base)
    with pytest.raises(impl.ContractViolation, match=message) as info:
        impl.paged_attention_with_metadata(stale.query, stale.key_pages, stale.value_pages, meta)
    assert info.value.clause == "metadata_stale"


@pytest.mark.builtin_only("prevalidated metadata and the unvalidated compiled entry point")
def test_metadata_build_rejects_bad_values():
    base = _base()
    with pytest.raises(impl.ContractViolation, match=r"block_table\[0, 1\] = 70 is outside the pool \[0, 7\)"):
        impl.PagedMetadata.build(np.array(_table(base, 0, 1, 70)), np.array(base.context_lens), page_size=4,
                                 num_pages=7, query_len=3)


def _unchecked(case) -> np.ndarray:
    """The compiled entry point on the case's arrays with the options impl would pass, and
    none of its checks."""
    args = case.args()[:5] + (case.page_size, case.query.shape[-1] ** -0.5, True, 0)
    return np.array(pagecheck_kernels.paged_attention(*args)[0])


# name -> (the valid batch, its corruption), each far outside its bound (the exact
# bounds are test_unchecked_kernel_at_the_exact_bounds' below).
UNCHECKED = {
    "page-id-high": ((10, 3), lambda c: c.with_(block_table=_table(c, 0, 1, 999))),
    "page-id-negative": ((10, 3), lambda c: c.with_(block_table=_table(c, 0, 1, -7))),
    "context-past-table": ((12, 4), lambda c: c.with_(context_lens=mx.array([20, 4], dtype=mx.int32))),
    "context-short": ((10, 3), lambda c: c.with_(context_lens=mx.array([1, 3], dtype=mx.int32))),
    "context-negative": ((10, 3), lambda c: c.with_(context_lens=mx.array([-4, 3], dtype=mx.int32))),
}


@pytest.mark.builtin_only("prevalidated metadata and the unvalidated compiled entry point")
@pytest.mark.parametrize("name", sorted(UNCHECKED))
def test_unchecked_kernel_never_reads_outside_the_pool(name):
    """The compiled entry point, called without the Python checks, turns a request it
    cannot compute safely (page id outside the pool, a context past its table row or
    shorter than L) into NaN instead of reading outside the pool; the other requests
    are computed as usual."""
    lens, corrupt = UNCHECKED[name]
    base = _base(lens)
    out = _unchecked(corrupt(base))
    assert np.isnan(out[0]).all()
    assert bits(mx.array(out[1:])) == bits(base.run(impl.paged_attention)[1:])


def _guarded(case):
    """The same call with each pool a view into a buffer one finite page longer at both
    ends: a kernel that reads page -1 or page P reads finite keys there (deterministically,
    and inside a buffer), so only the safety net, not the luck of what lies past the
    pool, can make that request NaN. Free pages and unwritten slots hold 0.25, not NaN,
    so a request on any page of the pool computes a finite output."""
    def guard(pages):
        pad = mx.full((1, *pages.shape[1:]), 0.5, dtype=pages.dtype)
        whole = mx.concatenate([pad, pages, pad])
        mx.eval(whole)
        return whole[1:-1]

    return case.with_(key_pages=guard(case.key_pages), value_pages=guard(case.value_pages))


def _bounds_base(lens=(10, 3)):
    # request 0: 10 positions in 3 pages of 4 (max_pages = 3, L = 3, P = 7); request 1: 3 in 1
    return _guarded(paged_case(context_lens=list(lens), query_len=3, q_heads=4, kv_heads=2, head_dim=8,
                               page_size=4, seed=43, max_pages=3, fill=0.25))


def _lens(*lens):
    return lambda c: c.with_(context_lens=mx.array(list(lens), dtype=mx.int32))


P_BOUNDS = 7  # pages in _bounds_base's pool
# name -> (corruption of request 0 in _bounds_base, whether the contract allows it). Pages
# are full in "pages-*" (base lens 12, 4), so the entry one past request 0's row
# (request 1's first page, the next int32 of the table) holds written keys: a kernel
# trusting max_pages computes a finite row there.
BOUNDS = {
    "page-id--1": (lambda c: c.with_(block_table=_table(c, 0, 1, -1)), False),
    "page-id-0": (lambda c: c.with_(block_table=_table(c, 0, 1, 0)), True),
    "page-id-P-1": (lambda c: c.with_(block_table=_table(c, 0, 1, P_BOUNDS - 1)), True),
    "page-id-P": (lambda c: c.with_(block_table=_table(c, 0, 1, P_BOUNDS)), False),
    "pages-max_pages": (_lens(12, 4), True),
    "pages-max_pages+1": (_lens(13, 4), False),
    "context-L": (_lens(3, 3), True),
    "context-L-1": (_lens(2, 3), False),
    "context-0": (_lens(0, 3), True),
    "context--1": (_lens(-1, 3), False),
}


@pytest.mark.builtin_only("prevalidated metadata and the unvalidated compiled entry point")
@pytest.mark.parametrize("name", list(BOUNDS))
def test_unchecked_kernel_at_the_exact_bounds(name):
    """paged_attention.cpp's request_is_safe at each of its bounds: page id -1 / 0 / P-1 / P, a row
    needing exactly max_pages pages / one more, context L / L-1, 0 / -1. Inside a bound
    the unchecked request's output is the validated operator's, bit for bit (and finite);
    outside it is all NaN and the other request keeps the validated operator's bits."""
    corrupt, valid = BOUNDS[name]
    base = _bounds_base((12, 4) if name.startswith("pages-") else (10, 3))
    assert base.key_pages.shape[0] == P_BOUNDS
    case = corrupt(base)
    out = _unchecked(case)
    if valid:
        want = case.run(impl.paged_attention)
        assert np.isfinite(out).all()
        assert bits(mx.array(out)) == bits(want)
    else:
        with pytest.raises(impl.ContractViolation):
            case.run(impl.paged_attention)  # the validated operator rejects it
        assert np.isnan(out[0]).all(), "request 0 is outside a bound but was computed"
        assert bits(mx.array(out[1:])) == bits(base.run(impl.paged_attention)[1:])


@pytest.mark.builtin_only("prevalidated metadata and the unvalidated compiled entry point")
@pytest.mark.parametrize("dtype", [np.int64, np.uint32, np.float32])
def test_metadata_build_rejects_numpy_metadata_that_is_not_int32(dtype):
    base = _base()
    for table, lens, name in ((np.array(base.block_table).astype(dtype), np.array(base.context_lens), "block_table"),
                              (np.array(base.block_table), np.array(base.context_lens).astype(dtype), "context_lens")):
        with pytest.raises(impl.ContractViolation, match=rf"{name} must be int32, got {np.dtype(dtype).name}") as e:
            impl.PagedMetadata.build(table, lens, page_size=4, num_pages=7, query_len=3)
        assert e.value.clause == "metadata_dtype"
