"""`impl.paged_attention_now`: the serving call computed in the calling thread and returned
evaluated (impl/csrc/paged_attention.cpp `paged_attention_now`), beside the lazy
`paged_attention_with_metadata`.

| what must hold                                                              | test                                   |
|-----------------------------------------------------------------------------|----------------------------------------|
| the lazy entry's bits, output and lse, for every dtype, schedule, v2 option, KV format and layout | test_now_gives_the_lazy_bits |
| inputs still being computed (lazy queries, pools, metadata) are waited for  | test_now_waits_for_lazy_inputs         |
| strided, transposed and offset views are read by value                      | test_now_reads_views_by_value          |
| the output is computed: it holds no pool, so the next write stays in place  | test_now_output_pins_no_pool           |
| bad input: the lazy entry's ContractViolation, nothing computed             | test_now_rejects_as_the_lazy_entry     |
| the conformance catalog passes on it with the built-in's whole declaration  | test_now_plugin_passes_the_catalog     |
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import impl
from conformance.formats import kv
from fixtures import paged_case
from fixtures.serving import make_pool, pool_rows
from impl.errors import ContractViolation
from impl.pool import pool_copies
from impl.validation import PagedMetadata
from tests.bitwise import result_bits
from tests.test_kernel_inputs import ARGS, VIEWS, _as, _numpy

pytestmark = [pytest.mark.correctness, pytest.mark.builtin_only("the built-in kernel's eager entry point")]

# (paged_case arguments, call options): each reaches another branch of the kernel.
CASES = {
    "decode-f32-gqa-empty-slot": (dict(context_lens=[37, 0, 20], query_len=1, q_heads=4, kv_heads=2), {}),
    "decode-bf16-8-rows-window": (dict(context_lens=[300, 41], query_len=8, dtype="bfloat16", window=50), {}),
    "prefill-f16-unmasked": (dict(context_lens=[70, 33], query_len=33, dtype="float16", mask=None), {}),
    "prefill-bf16-v2": (dict(context_lens=[290], query_len=40, dtype="bfloat16"),
                        dict(softcap=20.0, alibi=True, sinks=True, return_lse=True)),
    "decode-f32-dv": (dict(context_lens=[90, 12], query_len=1, value_dim=16), dict(return_lse=True)),
    "decode-int8-token-scales": (dict(context_lens=[60, 9], query_len=2), dict(kv="int8")),
    "decode-bf16-packed": (dict(context_lens=[300, 17], query_len=1, dtype="bfloat16", page_size=32,
                                head_dim=64), dict(packed=True)),
}


def _call(name, seed=5):
    """(case, metadata, keyword arguments of the serving call, the pools it reads)."""
    shape, options = CASES[name]
    shape, options = {"q_heads": 4, "kv_heads": 2, "head_dim": 32, "page_size": 16, **shape}, dict(options)
    dim = shape.pop("value_dim", None)
    case = paged_case(**shape, seed=seed)
    if dim is not None:
        case = case.with_(value_pages=mx.contiguous(case.value_pages[..., :dim]))
    rng = np.random.default_rng(seed)
    hq = shape["q_heads"]
    if options.pop("alibi", False):
        options["alibi_slopes"] = mx.array(rng.uniform(0.01, 0.2, size=hq).astype(np.float32))
    if options.pop("sinks", False):
        options["sinks"] = mx.array(rng.normal(size=hq).astype(np.float32))
    keys, values = case.key_pages, case.value_pages
    if options.pop("kv", None) == "int8":
        keys, values = (mx.array(rng.integers(-127, 128, size=p.shape).astype(np.int8)) for p in (keys, values))
        options.update(kv_dtype="int8", k_scale=mx.array(rng.uniform(0.005, 0.02, size=keys.shape[:3]), mx.float32),
                       v_scale=mx.array(rng.uniform(0.005, 0.02, size=keys.shape[:3]), mx.float32))
    if options.pop("packed", False):
        arrays = kv.pack("amx_packed", keys, values)
        keys, values = arrays["key_cache"], arrays["value_cache"]
        options["kv_layout"] = "amx_packed"
    kwargs = {**case.kwargs(), **options}
    meta = PagedMetadata.build(case.block_table, case.context_lens, page_size=case.page_size,
                               num_pages=keys.shape[0], query_len=case.query.shape[2])
    return case, meta, kwargs, (keys, values)


def _lazy(case, meta, kwargs, pools):
    result = impl.paged_attention_with_metadata(case.query, *pools, meta, **kwargs)
    mx.eval(result)
    return result


@pytest.mark.parametrize("name", sorted(CASES))
def test_now_gives_the_lazy_bits(name):
    """One kernel behind both entries: the same bits, output and lse."""
    case, meta, kwargs, pools = _call(name)
    now = impl.paged_attention_now(case.query, *pools, meta, **kwargs)
    assert result_bits(now) == result_bits(_lazy(case, meta, kwargs, pools))


def test_now_waits_for_lazy_inputs():
    """Query, pools and metadata all unevaluated graph nodes: each is computed before the
    kernel reads it (reading one early would read no buffer at all)."""
    case, meta, kwargs, pools = _call("decode-bf16-8-rows-window")
    expected = result_bits(_lazy(case, meta, kwargs, pools))
    zero = mx.zeros((1,), dtype=case.query.dtype)
    lazy_meta = PagedMetadata(meta.block_table + 0, meta.context_lens * 1, meta.block_table_host,
                              meta.context_lens_host, meta.page_size, meta.num_pages, meta.query_len)
    out = impl.paged_attention_now(case.query + zero, pools[0] + zero, pools[1] - zero, lazy_meta, **kwargs)
    assert result_bits(out) == expected


@pytest.mark.parametrize("view", sorted(VIEWS))
@pytest.mark.parametrize("arg", ARGS)
def test_now_reads_views_by_value(arg, view):
    """An input that is a view (not row-contiguous) is read through a contiguous copy:
    the same bits as the plain call."""
    case, meta, kwargs, pools = _call("decode-f32-gqa-empty-slot")
    expected = result_bits(_lazy(case, meta, kwargs, pools))
    arrays = dict(zip(ARGS, (case.query, *pools, meta.block_table, meta.context_lens)))
    arrays[arg] = VIEWS[view](_numpy(arrays[arg])) if arg in ("block_table", "context_lens") else \
        _as(arrays[arg], VIEWS[view](_numpy(arrays[arg])))
    mx.eval(arrays[arg])
    viewed = PagedMetadata(arrays["block_table"], arrays["context_lens"], meta.block_table_host,
                           meta.context_lens_host, meta.page_size, meta.num_pages, meta.query_len)
    out = impl.paged_attention_now(arrays["query"], arrays["key_pages"], arrays["value_pages"], viewed, **kwargs)
    assert result_bits(out) == expected


def test_now_output_pins_no_pool():
    """A lazy output keeps its pool alive as a graph input until it is evaluated, so a
    write before that must copy the layer; the computed output holds only its own
    buffer: the write stays in place, and the output keeps the values from before it."""
    pool = make_pool(num_layers=1, kv_heads=2, head_dim=32, page_size=16, num_pages=8)
    pool.allocate(2)
    pool.write(0, range(20), pool_rows(pool, 20, seed=1), pool_rows(pool, 20, seed=2))
    lens = mx.array([20], dtype=mx.int32)
    meta = PagedMetadata.build(mx.array([[0, 1]], dtype=mx.int32), lens, page_size=16, num_pages=8, query_len=1)
    query = mx.array(np.random.default_rng(3).standard_normal((1, 4, 1, 32)).astype(np.float32))
    mx.eval(pool.keys(0), pool.values(0))
    before = impl.paged_attention_with_metadata(query, pool.keys(0), pool.values(0), meta)
    mx.eval(before)
    copies = pool_copies()
    out = impl.paged_attention_now(query, pool.keys(0), pool.values(0), meta)
    pool.write(0, [3], pool_rows(pool, 1, seed=9), pool_rows(pool, 1, seed=10))
    mx.eval(pool.keys(0), pool.values(0))
    assert pool_copies() == copies
    assert result_bits(out) == result_bits(before)


@pytest.mark.parametrize("change,clause", [
    (dict(kv_layout="rows"), "kv_layout"),
    (dict(window=0), "window"),
    (dict(query_len=2), "metadata_stale"),
    (dict(dtype="int8"), "dtype"),
])
def test_now_rejects_as_the_lazy_entry(change, clause):
    """The same checks before either entry reaches the kernel: the same clause and
    message from both."""
    case, meta, kwargs, pools = _call("decode-f32-gqa-empty-slot")
    change, query = dict(change), case.query
    if change.pop("query_len", None):
        query = mx.concatenate([query, query], axis=2)
    if change.pop("dtype", None):
        query = query.astype(mx.int8)
    kwargs = {**kwargs, **change}
    errors = []
    for entry in (impl.paged_attention_with_metadata, impl.paged_attention_now):
        with pytest.raises(ContractViolation) as err:
            entry(query, *pools, meta, **kwargs)
        errors.append((err.value.clause, str(err.value)))
    assert errors[0] == errors[1] and errors[0][0] == clause


def test_now_plugin_passes_the_catalog(tmp_path):
    """impl.now's plug-in (the contract's call through PagedMetadata.build into
    paged_attention_now) under the built-in's whole declaration: the operator's checks,
    invariants and rejections all run and pass."""
    from tests.test_plugin import run_catalog

    files = ["tests/test_hand_fixtures.py", "tests/test_differential.py", "tests/test_invariants.py",
             "tests/test_rejections.py", "tests/test_edges.py", "tests/test_oracles_v2.py",
             "tests/test_oracles_v2_by_hand.py", "tests/test_kv_catalog.py"]
    proc, record = run_catalog("impl.now:paged_attention", tmp_path, files)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert record["verdict"] == "PASS" and record["counts"]["passed"] >= 400, record["counts"]
    ran = {c["id"].split("::")[0] for c in record["checks"] if c["outcome"] == "passed"}
    assert set(files) <= ran, set(files) - ran
