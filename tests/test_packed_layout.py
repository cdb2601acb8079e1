"""The tile-packed page layout (`kv_layout="amx_packed"`; impl/csrc/packed_layout.h,
conformance/formats/kv.py): the serving path's opt-in page order that the AMX tiles read
without packing.

| what must hold                                                          | test                                        |
|-------------------------------------------------------------------------|---------------------------------------------|
| packed pages give the row layout's bits, on the tiles and on the FMA path (every schedule, window, v2 option, NaN in unused slots) | test_packed_pages_give_the_row_bits |
| ... and meet the tolerance against the oracles, read through the converter | test_packed_pages_meet_the_tolerance      |
| a packed pool's writes put every element where the layout's definition says (whole pool state, every layer, poisoned frees) | test_pool_writes_the_packed_order |
| the serving path reads a packed pool through its kv_options               | test_serving_batch_reads_a_packed_pool      |
| the conformance catalog passes on packed pages (impl.packed's plug-in)    | test_packed_plugin_passes_the_catalog       |
| bad layouts are specific errors, nothing computed or written              | test_bad_layouts_are_rejected, test_bad_packed_pools_are_rejected |
"""

import math

import mlx.core as mx
import numpy as np
import pytest

import impl
from conformance.formats import kv
from fixtures import bits, paged_case
from impl.errors import ContractViolation, ServingError
from impl.pool import PagePool
from impl.validation import PagedMetadata
from oracles.compare import compare
from tests.bitwise import result_bits
from tests.format_impls import _packed_key_index, _packed_value_index
from tests.tile_path import tile_path

pytestmark = [pytest.mark.correctness, pytest.mark.builtin_only("the built-in kernel's packed page layout")]

# (context_lens, query_len, q_heads, kv_heads, head_dim, page_size, window, options): each
# reaches another part of amx_walk.cpp place_units / packed_rows.h.
CASES = {
    # partial last slabs, an empty slot, a context inside one 32-key slab
    "decode-gqa": ([300, 0, 17], 1, 8, 2, 64, 32, None, {}),
    "decode-8-positions-window": ([520, 90], 8, 8, 2, 32, 64, 50, {}),  # slabs cut at both ends
    "decode-v2": ([257, 40], 1, 4, 1, 32, 32, None, dict(softcap=20.0, return_lse=True)),
    "prefill-pages-of-128": ([700, 300], 300, 4, 2, 128, 128, None, {}),
    "prefill-window-sinks": ([290], 40, 4, 1, 64, 32, 100, dict(sinks=True)),
    "prefill-unmasked-alibi": ([200, 50], 20, 4, 2, 32, 32, None, dict(mask=None, alibi=True)),
}


def packed_case(name, seed=3):
    lens, L, hq, hkv, d, ps, window, options = CASES[name]
    options = dict(options)
    rng = np.random.default_rng(seed)
    if options.pop("sinks", False):
        options["sinks"] = mx.array(rng.normal(size=hq).astype(np.float32))
    if options.pop("alibi", False):
        options["alibi_slopes"] = mx.array(rng.uniform(0.01, 0.2, size=hq).astype(np.float32))
    mask = options.pop("mask", "causal")
    case = paged_case(context_lens=lens, query_len=L, q_heads=hq, kv_heads=hkv, head_dim=d, page_size=ps,
                      window=window, mask=mask, dtype="bfloat16", seed=seed)
    return case.with_(**options)


def run_packed(case):
    """The case on its pages converted to amx_packed, through the serving entry point."""
    arrays = kv.pack("amx_packed", case.key_pages, case.value_pages)
    meta = PagedMetadata.build(case.block_table, case.context_lens, page_size=case.page_size,
                               num_pages=case.key_pages.shape[0], query_len=case.query.shape[2])
    out = impl.paged_attention_with_metadata(case.query, arrays["key_cache"], arrays["value_cache"], meta,
                                             kv_layout="amx_packed", **case.kwargs())
    mx.eval(out)
    return out


@pytest.mark.parametrize("tiles", [True, False], ids=["tiles", "fma"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_packed_pages_give_the_row_bits(name, tiles):
    """The same elements in another order: each arithmetic reads the same operands
    (tiles: the same B tiles the row layout packs into scratch; FMA: the same rows), so
    every bit of the output and the lse agrees with the row layout's."""
    case = packed_case(name)
    with tile_path(tiles):
        rows = case.run(impl.paged_attention)
        packed = run_packed(case)
    assert result_bits(packed) == result_bits(rows)


@pytest.mark.parametrize("name", sorted(CASES))
def test_packed_pages_meet_the_tolerance(name, error_log):
    """Against the float64 and MLX oracles on the row pools that kv.unpack gives back."""
    case = packed_case(name, seed=11)
    out = run_packed(case)
    arrays = kv.pack("amx_packed", case.key_pages, case.value_pages)
    keys, values = kv.unpack("amx_packed", arrays)
    assert bits(keys) == bits(case.key_pages) and bits(values) == bits(case.value_pages)
    result = compare(out, case.with_(key_pages=keys, value_pages=values).args(), case.kwargs())
    error_log.record(case.dtype, "float64", result.against_float64)
    assert not result.failures(), result.failures()


def _pool(layout=None, **changes):
    kwargs = dict(num_layers=2, kv_heads=2, head_dim=32, page_size=32, dtype=mx.bfloat16, num_pages=4,
                  layout=layout, poison_freed=True)
    return PagePool(**{**kwargs, **changes})


def _rows(rng, n):
    return mx.array(rng.standard_normal((n, 2, 32)).astype(np.float32)).astype(mx.bfloat16)


def test_pool_writes_the_packed_order():
    """A packed pool and a row pool given the same writes (a partial page, a whole one,
    a poisoned free): in every layer, each element of the packed pool sits at the
    definition's index (tests/format_impls.py, not the converter) of its row-pool
    element, NaN included, and its kv_options name the layout."""
    rng = np.random.default_rng(0)
    pools = {layout: _pool(layout) for layout in (None, "amx_packed")}
    writes = [(0, list(range(5, 40))), (1, list(range(64, 96))), (0, [100, 3])]
    for pool in pools.values():
        pool.allocate(4)
    for layer, slots in writes:
        keys, values = _rows(rng, len(slots)), _rows(rng, len(slots))
        for pool in pools.values():
            pool.write(layer, slots, keys, values)
    for pool in pools.values():
        pool.free([2])
    rows, packed = pools[None], pools["amx_packed"]
    assert packed.kv_options(0) == {"kv_layout": "amx_packed"} and rows.kv_options(0) == {}
    slot = np.arange(32)[:, None]
    d = np.arange(32)[None, :]
    for layer in range(2):
        for got, want, index in ((packed.keys(layer), rows.keys(layer), _packed_key_index),
                                 (packed.values(layer), rows.values(layer), _packed_value_index)):
            flat = np.array(got.astype(mx.float32)).reshape(4, 2, 32 * 32)
            want = np.array(want.astype(mx.float32))
            np.testing.assert_array_equal(flat[:, :, index(slot, d, 32)], want)
    assert np.isnan(np.array(packed.keys(0).astype(mx.float32))[2]).all()  # the freed page, poisoned


@pytest.mark.parametrize("tiles", [True, False], ids=["tiles", "fma"])
def test_serving_batch_reads_a_packed_pool(tiles):
    """A step of impl.batch's StepBatch on a packed pool (caches appended, a forked one
    copied on write, the step's rows written, then attended with the pool's kv_options):
    the same bits in every layer as on a row pool given the same appends."""
    from impl.batch import StepBatch
    from impl.cache import PagedCache

    outs = {}
    for layout in (None, "amx_packed"):
        rng = np.random.default_rng(1)
        pool = _pool(layout, num_pages=12)
        first = PagedCache(pool)
        first.append([_rows(rng, 40) for _ in range(2)], [_rows(rng, 40) for _ in range(2)])
        caches = [first, first.fork(), PagedCache(pool)]
        caches[2].append([_rows(rng, 7) for _ in range(2)], [_rows(rng, 7) for _ in range(2)])
        for cache in caches:
            cache.reserve(3)
        step = StepBatch(caches, query_len=3)
        layer_outs = []
        for layer in range(2):
            new = [mx.array(rng.standard_normal((3, 2, 3, 32)).astype(np.float32)).astype(mx.bfloat16)
                   for _ in range(2)]
            step.write(layer, *new)
            query = mx.array(rng.standard_normal((3, 4, 3, 32)).astype(np.float32)).astype(mx.bfloat16)
            with tile_path(tiles):
                out = step.attend(layer, query)
                mx.eval(out)
            layer_outs.append(bits(out))
        outs[layout] = layer_outs
    assert outs["amx_packed"] == outs[None]


@pytest.mark.parametrize("change,why", [
    (dict(kv_layout="rows"), "kv_layout must be None"),
    (dict(kv_layout=1), "kv_layout must be None"),
    (dict(dtype="float32"), r"^amx_packed pages hold bfloat16 \(the tiles' operands\), got float32 pages$"),
    (dict(page_size=16), "multiples of 32"),
    (dict(head_dim=48), "multiples of 32"),
    (dict(value_dim=32), "Dv = Dk"),
])
def test_bad_layouts_are_rejected(change, why):
    """kv_layout's clause, raised before the kernel is called."""
    change = dict(change)
    layout = change.pop("kv_layout", "amx_packed")
    dim = change.pop("value_dim", None)
    kwargs = dict(context_lens=[40], query_len=1, head_dim=64, page_size=32, dtype="bfloat16", seed=1)
    case = paged_case(**{**kwargs, **change})
    if dim is not None:
        case = case.with_(value_pages=case.value_pages[..., :dim])
    meta = PagedMetadata.build(case.block_table, case.context_lens, page_size=case.page_size,
                               num_pages=case.key_pages.shape[0], query_len=1)
    with pytest.raises(ContractViolation, match=why) as err:
        impl.paged_attention_with_metadata(case.query, case.key_pages, case.value_pages, meta, kv_layout=layout)
    assert err.value.clause == "kv_layout"


def test_quantized_pages_cannot_be_packed():
    case = paged_case(context_lens=[40], query_len=1, head_dim=64, page_size=32, dtype="bfloat16", seed=1)
    codes = mx.zeros(case.key_pages.shape, dtype=mx.uint8)
    meta = PagedMetadata.build(case.block_table, case.context_lens, page_size=32,
                               num_pages=case.key_pages.shape[0], query_len=1)
    with pytest.raises(ContractViolation, match=r"got bfloat16 pages of float8_e4m3fn codes$") as err:
        impl.paged_attention_with_metadata(case.query, codes, codes, meta, kv_dtype="float8_e4m3fn",
                                           kv_layout="amx_packed")
    assert err.value.clause == "kv_layout"


def test_the_contract_entry_point_takes_rows_only():
    case = paged_case(context_lens=[40], query_len=1, head_dim=64, page_size=32, dtype="bfloat16", seed=1)
    with pytest.raises(TypeError, match="kv_layout"):
        impl.paged_attention(*case.args(), kv_layout="amx_packed")


@pytest.mark.parametrize("change,why", [
    (dict(layout="AMX"), "layout must be None"),
    (dict(layout=1), "layout must be None"),
    (dict(dtype=mx.float32), "holds bfloat16 pages"),
    (dict(kv_dtype="int8", fill=math.nan), "as int8 codes"),
    (dict(page_size=16), "multiples of 32"),
    (dict(head_dim=40), "multiples of 32"),
])
def test_bad_packed_pools_are_rejected(change, why):
    with pytest.raises(ServingError, match=why) as err:
        _pool(**{"layout": "amx_packed", **change})
    assert err.value.clause == "kv_layout"


def test_packed_plugin_passes_the_catalog(tmp_path):
    """impl.packed's plug-in: the catalog's checks on bfloat16 pages of multiples of 32,
    converted to amx_packed, judged by the oracles on the row pools; nothing fails, and
    the hand fixtures, the differential cases, the hypothesis layouts (drawn from the
    declaration) and the edges run. (test_invariants and test_rejections fix float32
    shapes of small pages: they skip for this declaration; the bit checks above hold the
    packed pages to the row layout's bits instead.)"""
    from tests.test_plugin import run_catalog

    files = ["tests/test_hand_fixtures.py", "tests/test_differential.py", "tests/test_properties.py",
             "tests/test_edges.py"]
    proc, record = run_catalog("impl.packed:paged_attention_amx_packed", tmp_path, files)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert record["capabilities"]["layout"] == "amx_packed" and record["counts"]["passed"] >= 50, record["counts"]
    ran = {c["id"].split("::")[0] for c in record["checks"] if c["outcome"] == "passed"}
    assert set(files) <= ran, ran
