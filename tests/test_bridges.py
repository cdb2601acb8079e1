"""The bridges (conformance/bridges.py) and the catalog through foreign formats.

The torch bridge hands the kernel tensors in the query's own dtype and brings the result
back bit for bit; the kernel's exceptions pass through as its own. Each native-format
kernel of tests/format_impls.py (and the torch one) passes the operator catalog through
its converters, unchanged; each kernel that misreads a convention fails at its clause.
Contract v2 crosses the bridges too: the slopes and sinks go in as the framework's arrays,
`(out, lse)` comes back converted (lse float32 `[B, Hq, L]`, from packed queries too), and
a torch kernel computing sinks and the lse (tests/torch_impls.py) matches the float64
oracle and passes the v2 hand fixtures; the v2 native kernels of tests/format_impls.py
(FlashInfer-, FlashAttention-2- and vLLM-like conventions) pass the catalog.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from conformance import from_mlx, load
from conformance.bridges import from_numpy
from fixtures import bits, paged_case
from tests import format_impls
from tests.test_plugin import run_catalog

# The operator checks a non-validating kernel runs (its rejections are declared away): a
# child pytest per kernel costs 6-10 s here.
CATALOG = ["tests/test_hand_fixtures.py", "tests/test_differential.py", "tests/test_mixed_lengths.py",
           "tests/test_invariants.py"]


def _case(dtype="bfloat16"):
    return paged_case(context_lens=[9, 0, 14], query_len=2, q_heads=4, kv_heads=2, head_dim=8, page_size=4,
                      dtype=dtype, seed=11)


@pytest.fixture
def torch():
    return pytest.importorskip("torch", reason="the torch bridge needs torch (pip install torch==2.13.0)")


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_torch_bridge_keeps_dtype_and_bits(dtype, torch):
    from conformance.bridges import from_torch

    seen = {}

    def kernel(query, key_pages, value_pages, block_table, context_lens, page_size, *, scale, mask, window):
        seen.update(query=query.dtype, pool=key_pages.dtype, table=block_table.dtype, device=str(query.device),
                    kinds={type(x) for x in (query, key_pages, value_pages, block_table, context_lens)})
        return query.clone()

    case = _case(dtype)
    out = case.run(from_torch(kernel))
    want = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    assert seen == {"query": want, "pool": want, "table": torch.int32, "device": "cpu", "kinds": {torch.Tensor}}
    assert out.dtype == case.dtype and bits(out) == bits(case.query)


def test_torch_bridge_hands_empty_arrays_as_contiguous_tensors(torch):
    """NumPy gives a 0-element array strides of 0; a kernel checking `stride(-1) == 1`
    (vLLM's) must see an ordinary empty tensor."""
    from conformance.bridges import from_torch

    seen = {}

    def kernel(**kw):
        seen.update({k: (tuple(v.shape), v.stride(), v.dtype) for k, v in kw.items() if isinstance(v, torch.Tensor)})
        return torch.zeros(kw["query"].shape, dtype=kw["query"].dtype)

    case = paged_case(context_lens=[0, 0], query_len=2, head_dim=8, dtype="bfloat16")
    out = case.run(from_torch(kernel, query_packing="varlen"))
    shape, stride, dtype = seen["query"]
    assert shape == (0, 4, 8) and stride == (32, 8, 1) and dtype == torch.bfloat16
    assert out.shape == case.query.shape and not np.array(out.astype(mx.float32)).any()


def test_torch_bridge_passes_the_kernels_errors_through(torch):
    from conformance.bridges import from_torch

    def kernel(*args, **kwargs):
        raise RuntimeError("page id 999 out of range (the kernel's own words)")

    with pytest.raises(RuntimeError, match=r"the kernel's own words"):
        _case().run(from_torch(kernel, error_types=[RuntimeError]))


def test_torch_bridge_widens_only_when_declared(torch):
    from conformance.bridges import from_torch

    seen = []

    def kernel(query, *args, **kwargs):
        seen.append(query.dtype)
        return query * 1  # float32 when widened

    case = _case("bfloat16")
    out = case.run(from_torch(kernel, widens_to="float32"))
    assert seen == [torch.float32] and out.dtype == mx.bfloat16 and bits(out) == bits(case.query)
    raw = case.run(from_torch(lambda query, *a, **k: query.float()))
    assert raw.dtype == mx.float32, "without widens_to the kernel's own result dtype must come back unchanged"


def test_torch_bridge_rejects_what_it_cannot_carry(torch):
    from conformance.bridges import from_torch

    with pytest.raises(TypeError, match="expected a torch.Tensor"):
        _case().run(from_torch(lambda *a, **k: np.zeros(3)))
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda'"):
        from_torch(lambda *a, **k: None, device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="no CUDA device"):
            from_torch(lambda *a, **k: None, device="cuda")


def test_torch_bridge_native_call_gets_its_format(torch):
    from conformance.bridges import from_torch

    seen = {}

    def kernel(**kw):
        seen.update({k: (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else v for k, v in kw.items()})
        return torch.zeros(kw["query"].shape, dtype=kw["query"].dtype)

    case = _case("float16")
    case.run(from_torch(kernel, layout="nhd", query_packing="varlen", window_convention="flash"))
    P = case.key_pages.shape[0]
    assert seen["query"] == ((4, 4, 8), torch.float16)  # two requests of L = 2; the empty slot packs none
    assert seen["key_cache"] == ((P, 4, 2, 8), torch.float16) and seen["cu_seqlens_q"] == ((4,), torch.int32)
    assert seen["window_size"] == (-1, -1) and seen["causal"] is True and seen["max_seqlen_q"] == 2


def test_bridges_add_their_copies_to_the_memory_estimate():
    plain = from_numpy(lambda *a, **k: None)
    native = from_numpy(lambda **k: None, layout="nhd", extra_memory=1.0)
    assert plain.pagecheck_capabilities["extra_memory"] == 4.0 + 2
    assert native.pagecheck_capabilities["extra_memory"] == 1.0 + 2 + 1
    assert native.pagecheck_capabilities["framework"] == "numpy"


def test_load_converts_an_mlx_kernel_that_declares_a_format(monkeypatch):
    import sys
    import types

    def kernel(**kw):
        assert set(kw) >= {"key_cache", "value_cache", "kv_indptr", "window_left"}
        return mx.zeros(kw["query"].shape, dtype=kw["query"].dtype)

    kernel.pagecheck_capabilities = {"layout": "nhd", "page_table": "csr", "window_convention": "flashinfer"}
    monkeypatch.setitem(sys.modules, "native_mlx_kernel", types.SimpleNamespace(kernel=kernel))
    impl = load("native_mlx_kernel:kernel")
    assert impl.caps.layout == "nhd" and impl.caps.framework == "mlx"
    case = _case("float32")
    assert case.run(impl.fn).shape == case.query.shape
    assert from_mlx(kernel).pagecheck_contract_form


@pytest.mark.parametrize("name", format_impls.CORRECT + format_impls.CORRECT_V2)
def test_native_format_kernel_passes_the_catalog(name, tmp_path):
    proc, record = run_catalog(f"tests.format_impls:{name}", tmp_path, CATALOG)
    assert proc.returncode == 0, proc.stdout[-4000:]
    ran = {c["id"].split("::")[0] for c in record["checks"] if c["outcome"] == "passed"}
    assert {"tests/test_hand_fixtures.py", "tests/test_differential.py"} <= ran, ran
    varlen = getattr(format_impls, name).pagecheck_capabilities.get("query_packing") == "varlen"
    assert ("tests/test_mixed_lengths.py" in ran) == varlen
    if name in format_impls.CORRECT_V2:  # contract v2 ran through its conversions, none skipped for lack of it
        assert all(f["declared"] and not f["skipped"] for f in record["features"].values()), record["features"]
        v2 = [c for c in record["checks"]
              if c["outcome"] == "passed" and {"sinks", "lse", "softcap"} & set(c["clauses"])]
        assert v2, "no contract-v2 check ran"


@pytest.mark.parametrize("name", sorted(format_impls.BROKEN))
def test_native_format_misread_fails_at_its_clause(name, tmp_path):
    clause = format_impls.BROKEN[name]
    proc, record = run_catalog(f"tests.format_impls:{name}", tmp_path, CATALOG[:3])
    assert proc.returncode == 1, proc.stdout[-4000:]
    failed = [c for c in record["checks"] if c["outcome"] == "failed"]
    assert any(clause in c["clauses"] for c in failed), [(c["id"], c["clauses"]) for c in failed][:10]


def test_torch_kernel_passes_the_catalog(torch, tmp_path):
    proc, record = run_catalog("tests.torch_impls:nhd_varlen_flash", tmp_path, CATALOG)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert record["capabilities"]["framework"] == "torch"
    assert record["counts"]["passed"] >= 100, record["counts"]


# -- contract v2 through the bridges -------------------------------------------------------

SLOPES = [0.5, 0.25, -0.125, 1.0]
SINKS = [0.5, -1.0, 3.0, -20.0]


def _v2_case(dtype="float32", value_dim=None, **options):
    case = _case(dtype)
    if value_dim:
        case = case.with_(value_pages=case.value_pages[..., :value_dim])
    return case.with_(**options)


def _against_float64(case, out, lse):
    from oracles import float64

    ref, ref_lse = float64(*case.args(), **case.kwargs())
    unit = {mx.float32: 2.0 ** -24, mx.float16: 2.0 ** -11, mx.bfloat16: 2.0 ** -8}[case.dtype]
    got = np.array(out.astype(mx.float32), dtype=np.float64)
    assert out.dtype == case.dtype and got.shape == ref.shape
    assert np.abs(got - ref).max() <= 2 * unit * np.abs(ref).max() + 1e-7, np.abs(got - ref).max()
    assert lse.dtype == mx.float32 and lse.shape == ref_lse.shape == case.query.shape[:3]
    lse = np.array(lse, dtype=np.float64)
    empty = np.isneginf(ref_lse)
    assert np.isneginf(lse[empty]).all() and empty[1].all()  # the empty slot
    assert np.abs(lse[~empty] - ref_lse[~empty]).max() <= 1e-6 * max(1.0, np.abs(ref_lse[~empty]).max())


@pytest.mark.parametrize("dtype,value_dim", [("float32", None), ("bfloat16", None), ("float16", 5)])
def test_torch_kernel_computes_sinks_and_lse_through_from_torch(dtype, value_dim, torch):
    from tests import torch_impls

    case = _v2_case(dtype, value_dim, sinks=mx.array(SINKS), return_lse=True, softcap=3.0,
                    alibi_slopes=mx.array(SLOPES))
    out, lse = case.run(torch_impls.v2_reference)
    _against_float64(case, out, lse)
    out, lse = case.run(torch_impls.v2_sinks_ignored)  # the check can fail: a sink dropped moves both
    with pytest.raises(AssertionError):
        _against_float64(case, out, lse)


def test_torch_bridge_hands_the_v2_arrays_as_tensors(torch):
    from conformance.bridges import from_torch

    seen = {}

    def kernel(query, key_pages, value_pages, block_table, context_lens, page_size, **options):
        seen.update({k: (type(v), v.dtype, tuple(v.shape)) if isinstance(v, torch.Tensor) else v
                     for k, v in options.items()})
        out = torch.zeros(query.shape[:3] + value_pages.shape[-1:], dtype=query.dtype)
        return (out, torch.zeros(query.shape[:3])) if options.get("return_lse") else out

    fn = from_torch(kernel, sinks=True, lse=True, alibi=True)
    case = _v2_case("bfloat16", sinks=mx.array(SINKS), alibi_slopes=np.array(SLOPES, dtype=np.float32),
                    return_lse=True)
    out, lse = case.run(fn)
    assert seen["sinks"] == (torch.Tensor, torch.float32, (4,))
    assert seen["alibi_slopes"] == (torch.Tensor, torch.float32, (4,))  # a NumPy one given: a tensor too
    assert seen["return_lse"] is True and "softcap" not in seen  # v2 keywords only when set
    assert out.dtype == mx.bfloat16 and lse.dtype == mx.float32 and lse.shape == (3, 4, 2)
    seen.clear()
    assert isinstance(_case().run(fn), mx.array) and seen == {"scale": None, "mask": "causal", "window": None}


def test_torch_lse_comes_back_in_its_own_dtype_unless_widened(torch):
    from conformance.bridges import from_torch

    def kernel(query, key_pages, value_pages, block_table, context_lens, page_size, **options):
        return torch.zeros_like(query), torch.zeros(query.shape[:3], dtype=torch.bfloat16)

    case = _v2_case("float16", return_lse=True)
    assert case.run(from_torch(kernel))[1].dtype == mx.bfloat16  # a wrong lse dtype fails the check
    widened = case.run(from_torch(kernel, widens_to="float32"))
    assert widened[0].dtype == mx.float16 and widened[1].dtype == mx.float32
    with pytest.raises(TypeError, match="lse of type ndarray"):
        case.run(from_torch(lambda *a, **k: (torch.zeros(1), np.zeros(1))))


def test_numpy_bridge_brings_the_lse_back_as_float32():
    def kernel(query, key_pages, value_pages, block_table, context_lens, page_size, **options):
        assert isinstance(options["sinks"], np.ndarray) and options["sinks"].dtype == np.float32
        return np.zeros(query.shape), np.zeros(query.shape[:3])

    case = _v2_case("bfloat16", sinks=mx.array(SINKS), return_lse=True)
    out, lse = case.run(from_numpy(kernel, sinks=True, lse=True))
    assert out.dtype == mx.bfloat16 and lse.dtype == mx.float32 and lse.shape == (3, 4, 2)
    with pytest.raises(TypeError, match="lse of type list"):
        case.run(from_numpy(lambda *a, **k: (np.zeros(1), [0.0])))


def test_varlen_lse_comes_back_padded_with_minus_inf(torch):
    """A native varlen kernel returns lse [T, Hq]; the contract gets [B, Hq, L], -inf
    where a request has no packed row (the empty slot)."""
    from tests import torch_impls

    case = _v2_case("float32", 6, sinks=mx.array(SINKS), alibi_slopes=mx.array(SLOPES), return_lse=True)
    seen = {}

    def spy(**kw):
        seen.update(query=tuple(kw["query"].shape))
        return torch_impls._nhd_varlen_flash(**kw)

    from conformance.bridges import from_torch

    out, lse = case.run(from_torch(spy, validates_input=False, **torch_impls.FORMAT, sinks=True, alibi=True,
                                   lse=True, value_head_dim=True))
    assert seen["query"] == (4, 4, 8)  # two requests of L = 2 packed; the empty slot has none
    _against_float64(case, out, lse)


@pytest.mark.parametrize("name", ["v2_reference", "nhd_varlen_flash"])
def test_torch_v2_kernel_passes_the_v2_hand_fixtures(name, torch, tmp_path):
    """The hand fixtures of contract v2 through a torch kernel declaring it (child pytest)."""
    impl = f"tests.torch_impls:{name}"
    if name == "nhd_varlen_flash":
        impl = "tests.torch_impls:nhd_varlen_flash_v2"
    proc, record = run_catalog(impl, tmp_path, ["tests/test_hand_fixtures.py::test_hand_fixture",
                                                "-k", "lse or sink or softcap or alibi or value_dim"])
    assert proc.returncode == 0, proc.stdout[-4000:]
    passed = [c for c in record["checks"] if c["outcome"] == "passed"]
    assert len(passed) >= 10, record["counts"]
    assert all(record["features"][f]["declared"] for f in record["features"])
