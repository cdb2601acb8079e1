"""The format converters (conformance/formats): each against its layout's definition, each
round trip bit for bit, every value without a faithful image a skip with the reason.

The definitions are tests/format_impls.py's accessors, written from the format tables and
not through the converters, so a converter and its inverse that agree on a wrong layout
still fail here.
"""

import mlx.core as mx
import numpy as np
import pytest

from conformance import formats
from conformance.capabilities import CHOICES, Capabilities
from conformance.formats import NotExpressible, conventions, kv, queries, tables
from fixtures import bits, paged_case
from tests.format_impls import _rows

LAYOUTS = CHOICES["layout"]


# amx_packed permutes whole 32 x 32 blocks of a page's slice: its pools are that large
PAGE_SIZES = {"amx_packed": 32}
HEAD_DIMS = {"amx_packed": 32}


def _pools(dtype="float32", D=16, layout=None):
    case = paged_case(context_lens=[9, 0, 20], query_len=3, q_heads=4, kv_heads=2, head_dim=max(D, HEAD_DIMS.get(layout, 0)),
                      page_size=PAGE_SIZES.get(layout, 4), dtype=dtype, fill=0.0, seed=7)
    return case


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_holds_each_element_where_its_definition_says(layout, dtype):
    case = _pools(dtype, layout=layout)
    P, hkv, ps, D = case.key_pages.shape
    arrays = kv.pack(layout, case.key_pages, case.value_pages)
    host = {k: np.array(v.astype(mx.float32)) for k, v in arrays.items()}
    pages, slots = np.repeat(np.arange(P), ps), np.tile(np.arange(ps), P)
    k, v = _rows(layout, host, pages, slots)  # [P * ps, Hkv, D]
    want_k = np.array(case.key_pages.astype(mx.float32)).transpose(0, 2, 1, 3).reshape(P * ps, hkv, D)
    want_v = np.array(case.value_pages.astype(mx.float32)).transpose(0, 2, 1, 3).reshape(P * ps, hkv, D)
    np.testing.assert_array_equal(k, want_k)
    np.testing.assert_array_equal(v, want_v)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_round_trip_keeps_every_bit(layout, dtype):
    case = paged_case(context_lens=[7, 3], query_len=1, head_dim=HEAD_DIMS.get(layout, 16),
                      page_size=PAGE_SIZES.get(layout, 4), dtype=dtype, seed=3)  # NaN fill
    k, v = kv.unpack(layout, kv.pack(layout, case.key_pages, case.value_pages))
    assert bits(k) == bits(case.key_pages) and bits(v) == bits(case.value_pages)
    assert k.dtype == case.key_pages.dtype


def test_vllm_split_shapes_and_its_x():
    case = _pools("float16", D=16)
    arrays = kv.pack("vllm_split", case.key_pages, case.value_pages)
    P, hkv, ps, D = case.key_pages.shape
    assert kv.split_x(mx.float16) == 8 and kv.split_x(mx.float32) == 4
    assert arrays["key_cache"].shape == (P, hkv, D // 8, ps, 8)
    assert arrays["value_cache"].shape == (P, hkv, D, ps)
    with pytest.raises(ValueError, match="D % 8"):
        kv.pack("vllm_split", case.key_pages[..., :12], case.value_pages[..., :12])


def test_csr_matches_its_definition():
    case = paged_case(context_lens=[9, 0, 20, 4], query_len=1, page_size=4, seed=5, max_pages=7)
    csr = tables.pack("csr", case.block_table, case.context_lens, 4)
    ptr, idx, last = (np.array(csr[k]) for k in ("kv_indptr", "kv_indices", "kv_last_page_len"))
    table = np.array(case.block_table)
    assert ptr.tolist() == [0, 3, 3, 8, 9]
    assert last.tolist() == [1, 0, 4, 4]  # 9 = 2 * 4 + 1; empty: 0; 20 = 4 * 4 + 4; 4 = 0 * 4 + 4
    assert idx.tolist() == table[0, :3].tolist() + table[2, :5].tolist() + table[3, :1].tolist()
    assert all(a.dtype == mx.int32 for a in csr.values())


def test_csr_round_trip_and_dtype():
    case = paged_case(context_lens=[9, 0, 20], query_len=1, page_size=4, seed=5)
    table, lens = tables.unpack("csr", tables.pack("csr", case.block_table, case.context_lens, 4), 4,
                                max_pages=case.block_table.shape[1])
    assert bits(lens) == bits(case.context_lens)
    want = np.array(case.block_table)
    need = -(-np.array(case.context_lens) // 4)
    got = np.array(table)
    for b, n in enumerate(need):
        assert got[b, :n].tolist() == want[b, :n].tolist() and (got[b, n:] == -1).all()
    wide = tables.pack("csr", case.block_table.astype(mx.int64), case.context_lens.astype(mx.int64), 4)
    assert wide["kv_indices"].dtype == mx.int64 and wide["kv_indptr"].dtype == mx.int64


@pytest.mark.parametrize("lens,why", [([9, -1], "negative context"), ([9, 40], "more pages than max_pages")])
def test_csr_refuses_what_it_cannot_express(lens, why):
    case = paged_case(context_lens=[9, 3], query_len=1, page_size=4, seed=5)
    with pytest.raises(NotExpressible, match=why):
        tables.pack("csr", case.block_table, mx.array(lens, dtype=mx.int32), 4)


def test_varlen_packs_each_requests_last_rows_and_unpacks_with_zero_slots():
    case = paged_case(context_lens=[9, 0, 5], query_len=3, q_heads=2, kv_heads=1, head_dim=8, seed=2)
    packed = queries.pack(case.query, queries.query_lens(case.context_lens, 3))
    assert np.array(packed["cu_seqlens_q"]).tolist() == [0, 3, 3, 6] and packed["max_seqlen_q"] == 3
    q = np.array(case.query)
    np.testing.assert_array_equal(np.array(packed["query"][3:]), q[2].swapaxes(0, 1))
    back = np.array(queries.unpack(packed["query"], packed["cu_seqlens_q"], 3))
    np.testing.assert_array_equal(back[[0, 2]], q[[0, 2]])
    assert not back[1].any()
    with pytest.raises(AssertionError, match="expected cu_seqlens_q"):
        queries.unpack(packed["query"][:5], packed["cu_seqlens_q"], 3)


@pytest.mark.parametrize("window,mask,flash,flashinfer", [
    (None, "causal", (-1, -1), -1), (1, "causal", (0, 0), 0), (8, "causal", (7, 0), 7), (None, None, (-1, -1), -1)])
def test_window_conventions_follow_the_table(window, mask, flash, flashinfer):
    assert conventions.window_args("count", window, mask) == {"window": window}
    assert conventions.window_args("flash", window, mask) == {"window_size": flash}
    assert conventions.window_args("flashinfer", window, mask) == {"window_left": flashinfer}
    for conv, args in (("flash", {"window_size": flash}), ("flashinfer", {"window_left": flashinfer}),
                       ("count", {"window": window})):
        assert conventions.window_count(conv, args) == window
    assert conventions.causal_flag(mask) is (mask == "causal")


@pytest.mark.parametrize("conv", ["flash", "flashinfer"])
@pytest.mark.parametrize("window,mask", [(0, "causal"), (-3, "causal"), (4, None), (2.5, "causal")])
def test_rejected_windows_have_no_image_in_left_counts(conv, window, mask):
    with pytest.raises(NotExpressible):
        conventions.window_args(conv, window, mask)
    assert conventions.window_args("count", window, mask) == {"window": window}  # passed as given


def test_not_expressible_is_a_skip_with_the_reason():
    assert issubclass(NotExpressible, pytest.skip.Exception)
    with pytest.raises(NotExpressible, match="mask='full'"):
        conventions.causal_flag("full")


def test_malformed_calls_have_no_native_image():
    case = _pools()
    caps = Capabilities.declared({"layout": "nhd"})
    for bad in (dict(query=case.query[0]), dict(page_size=8), dict(value_pages=case.value_pages[:, :, :2]),
                dict(query=np.array(case.query))):
        broken = case.with_(**bad)
        with pytest.raises(NotExpressible):
            formats.native(caps, *broken.args(), **broken.kwargs())
    mixed = case.with_(value_pages=case.value_pages.astype(mx.float16))
    with pytest.raises(NotExpressible, match="different dtypes"):
        formats.native(Capabilities.declared({"layout": "kv_hnd"}), *mixed.args(), **mixed.kwargs())


def test_native_call_resolves_scale_and_brings_the_output_back():
    case = _pools()
    caps = Capabilities.declared({"layout": "nhd", "query_packing": "varlen", "window_convention": "flash"})
    call = formats.native(caps, *case.args(), scale=None, mask="causal", window=5)
    assert call.kwargs["scale"] == 16 ** -0.5 and call.kwargs["causal"] is True
    assert call.kwargs["window_size"] == (4, 0) and call.kwargs["page_size"] == 4
    assert set(call.kwargs) == {"query", "cu_seqlens_q", "max_seqlen_q", "key_cache", "value_cache",
                                "block_table", "seq_lens", "page_size", "scale", "causal", "window_size"}
    assert bits(call.output(call.kwargs["query"])) == bits(mx.where(
        (case.context_lens > 0)[:, None, None, None], case.query, 0.0))


@pytest.mark.parametrize("key,value", [("layout", "NHD"), ("page_table", "coo"), ("query_packing", "ragged"),
                                       ("window_convention", "left"), ("device", "tpu"), ("block_multiple", 0),
                                       ("extra_memory", -1), ("widens_to", "float16"), ("framework", "jax")])
def test_bad_format_declarations_are_usage_errors(key, value):
    with pytest.raises(ValueError, match=key):
        Capabilities.declared({key: value})


def test_a_format_key_switches_to_the_native_call():
    assert not Capabilities.declared({"dtypes": ["float32"]}).native_call
    for key, value in (("layout", "hnd"), ("page_table", "padded"), ("query_packing", "padded"),
                       ("window_convention", "count")):
        assert Capabilities.declared({key: value}).native_call


# -- contract v2: Dv != Dk, the v2 keywords ------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
def test_values_of_another_head_dim_keep_their_place_or_have_no_image(layout):
    """Dv != Dk: the separate-pool layouts carry V of any head dim, element for element;
    a layout holding K and V in one tensor cannot (NotExpressible)."""
    case = _pools("float32", D=2 * HEAD_DIMS.get(layout, 8), layout=layout)
    dk = case.key_pages.shape[-1]
    dv = dk // 2  # Dv = 8, Dk = 16 (amx_packed: 32, 64)
    values = case.value_pages[..., :dv]
    wide = case.with_(value_pages=values)
    caps = Capabilities.declared({"layout": layout})
    if layout in formats.STACKED:
        with pytest.raises(NotExpressible, match=f"Dk = {dk} != Dv = {dv}"):
            formats.native(caps, *wide.args(), **wide.kwargs())
        return
    call = formats.native(caps, *wide.args(), **wide.kwargs())
    P, hkv, ps, _ = case.key_pages.shape
    host = {k: np.array(v) for k, v in call.kwargs.items() if k in ("key_cache", "value_cache")}
    pages, slots = np.repeat(np.arange(P), ps), np.tile(np.arange(ps), P)
    k, v = _rows(layout, host, pages, slots)
    np.testing.assert_array_equal(v, np.array(values).transpose(0, 2, 1, 3).reshape(P * ps, hkv, dv))
    assert k.shape[-1] == dk
    back_k, back_v = kv.unpack(layout, {n: call.kwargs[n] for n in ("key_cache", "value_cache")})
    assert bits(back_v) == bits(values) and bits(back_k) == bits(case.key_pages)


def test_native_call_gets_the_v2_keywords_only_when_set():
    case = _pools()
    caps = Capabilities.declared({"layout": "nhd", "query_packing": "varlen"})
    plain = formats.native(caps, *case.args(), **case.kwargs())
    assert not {"softcap", "alibi_slopes", "sinks", "return_lse"} & set(plain.kwargs)
    slopes, sinks = mx.array([0.5, 0.25, 0.125, 1.0]), mx.zeros(4)
    v2 = case.with_(softcap=30.0, alibi_slopes=slopes, sinks=sinks, return_lse=True)
    call = formats.native(caps, *v2.args(), **v2.kwargs())
    assert call.kwargs["softcap"] == 30.0 and call.kwargs["return_lse"] is True
    assert call.kwargs["alibi_slopes"] is slopes and call.kwargs["sinks"] is sinks
    # the result (out [T, Hq, Dv], lse [T, Hq]) comes back padded: zeros / -inf for the empty slot
    T = call.kwargs["query"].shape[0]
    out, lse = call.output((mx.ones((T, 4, 16)), mx.zeros((T, 4))))
    assert out.shape == (3, 4, 3, 16) and lse.shape == (3, 4, 3) and lse.dtype == mx.float32
    assert not np.array(out[1]).any() and np.isneginf(np.array(lse[1])).all()
    assert not np.array(lse[0]).any() and not np.array(lse[2]).any()
    with pytest.raises(TypeError, match="logits_soft_cap"):
        formats.native(caps, *case.args(), logits_soft_cap=30.0)
