"""Quantized KV pages through the `--impl` plumbing: the capability keys (`kv_dtypes`,
`kv_scales`, `kv_dtype_names`), the bridges (torch gets its own fp8 dtypes, NumPy the
codes, MLX everything as given; native layouts move per-token scales with their slots),
the repro of a quantized call, the report's KV section, and the kv catalog
(tests/test_kv_catalog.py) run as a user runs it, in a child pytest per kernel.

| check                                              | what it proves                                        |
|----------------------------------------------------|-------------------------------------------------------|
| declarations                                       | defaults (no format; `tensor` scales), the built-in declares all, bad values are ValueErrors naming them (UsageError through `--impl`) |
| `Capabilities.unsupported` on KV calls             | format undeclared, K's or V's granularity undeclared: a reason naming it (`kv_formats_in` reads it back); rejection checks are left to a declaring kernel |
| torch bridge                                       | `torch.float8_e4m3fn` / `torch.float8_e5m2` views of the very codes, `torch.int8`, float32 scale tensors (a float: 0-d), `kv_dtype` as declared |
| NumPy and MLX bridges                              | uint8 / int8 codes and float32 scales; MLX as given   |
| native layouts                                     | a per-token scale in the layout's slot order; every layout's float64 reference (tests/format_impls.py) matches the oracles on quantized pools |
| the kv catalog on torch kernels                    | the float64 torch reference passes it; each misreading kernel (tests/torch_impls.py KV_BROKEN) fails at clause kv_format; a kernel declaring nothing or part gets skips with reasons, never failures |
| repro and report                                   | a failed quantized check's script replays kv_dtype and scales; the report shows formats, skips and the quantization error apart |
"""

from __future__ import annotations

import sys
import types

import mlx.core as mx
import numpy as np
import pytest

from conformance import Capabilities, UsageError, from_mlx, from_numpy, load, repro, report
from conformance.capabilities import NO_KV_REASON, kv_formats_in, kv_reason
from conformance.formats import NotExpressible, kv
from conformance.plugin import Outcome, Recorder
from contract import GRANULARITIES, KV_DTYPES, ScorePipeline
from fixtures import paged_case
from fixtures.quantized import quantized
from oracles.compare import compare
from tests import format_impls
from tests.test_plugin import run_catalog
from tests.test_repro import run_script

torch = pytest.importorskip("torch", reason="the torch bridge needs torch (pip install torch==2.13.0)")
from conformance.bridges import from_torch  # noqa: E402 - after the torch check
from tests import torch_impls  # noqa: E402

CATALOG = ["tests/test_kv_catalog.py"]
TORCH_DTYPES = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2, "int8": torch.int8}


def _case(kv_dtype="float8_e4m3fn", k="head", v="token", dtype="bfloat16", page_size=4):
    base = paged_case(context_lens=[9, 0, 14], query_len=2, q_heads=4, kv_heads=2, head_dim=16,
                      page_size=page_size, dtype=dtype, seed=11)
    return quantized(base, kv_dtype, k=k, v=v)


def _unsupported(caps, case, pool=True):
    return caps.unsupported(dtype="bfloat16", head_dim=16, page_size=case.page_size, query_len=2,
                            pipeline=case.pipeline, pool=tuple(case.key_pages.shape) if pool else None)


# -- declarations --------------------------------------------------------------------------

def test_defaults_declare_no_format_and_tensor_scales():
    caps = Capabilities.declared(None)
    assert caps.kv_dtypes == frozenset() and caps.kv_scales == {"tensor"} and caps.kv_formats() == ()
    builtin = load(None).caps
    assert builtin.kv_formats() == tuple(KV_DTYPES) and builtin.kv_scales == set(GRANULARITIES)
    declared = Capabilities.declared({"kv_dtypes": ["int8", "float8_e4m3fn"], "kv_scales": ["token", "tensor"]})
    assert declared.summary()["kv_dtypes"] == ["float8_e4m3fn", "int8"]  # the contract's order
    assert declared.summary()["kv_scales"] == ["tensor", "token"]


@pytest.mark.parametrize("spec,message", [
    ({"kv_dtypes": ["fp8_e4m3"]}, r"kv_dtypes: unknown 'fp8_e4m3'"),
    ({"kv_dtypes": "int8"}, r"kv_dtypes must be a list"),
    ({"kv_scales": ["channel"]}, r"kv_scales: unknown 'channel'"),
    ({"kv_scales": []}, r"kv_scales is empty"),
    ({"kv_scales": "token"}, r"kv_scales must be a list"),
    ({"kv_dtype_names": {"fp8": "fp8_e4m3"}}, r"kv_dtype_names: unknown format 'fp8'"),
    ({"kv_dtype_names": {"int8": ""}}, r"kv_dtype_names: the name of int8 must be a non-empty str"),
    ({"kv_dtype_names": ["int8"]}, r"kv_dtype_names must be a dict"),
])
def test_bad_kv_capabilities_are_rejected(spec, message, monkeypatch):
    with pytest.raises(ValueError, match=message):
        Capabilities.declared(spec)

    def kernel(*args, **kwargs):
        raise AssertionError("never called")

    kernel.pagecheck_capabilities = spec
    monkeypatch.setitem(sys.modules, "kv_bad_declaration", types.SimpleNamespace(kernel=kernel))
    with pytest.raises(UsageError, match="bad pagecheck_capabilities: capability " + message):
        load("kv_bad_declaration:kernel")


# -- a call against the declaration --------------------------------------------------------

def test_undeclared_format_is_a_reason_naming_it():
    case = _case("float8_e5m2")
    for caps in (Capabilities.declared(None), Capabilities.declared({"kv_dtypes": ["float8_e4m3fn"]})):
        reason = _unsupported(caps, case)
        assert reason == "KV format float8_e5m2 (declare kv_dtypes=[..., 'float8_e5m2'] in pagecheck_capabilities)"
        assert kv_formats_in(reason) == ("float8_e5m2", "kv_dtypes")


@pytest.mark.parametrize("k,v,declared,named", [
    ("head", "tensor", ["tensor"], "k_scale per head"),
    ("tensor", "token", ["tensor", "head"], "v_scale per token"),
    ("token", "head", ["tensor"], "k_scale per token, v_scale per head"),
])
def test_undeclared_granularity_of_k_or_v_is_a_reason_naming_it(k, v, declared, named):
    case = _case("int8", k=k, v=v)
    caps = Capabilities.declared({"kv_dtypes": ["int8"], "kv_scales": declared})
    for pool in (True, False):  # the pool's shape tells the granularity; without it, the scale's rank does
        reason = _unsupported(caps, case, pool)
        assert reason.startswith(f"KV format int8 with {named} (declare kv_scales=[..., "), reason
        assert kv_formats_in(reason) == ("int8", "kv_scales")
    assert _unsupported(Capabilities.declared({"kv_dtypes": ["int8"], "kv_scales": [k, v]}), case) is None


def test_rejection_checks_are_left_to_a_declaring_kernel():
    """A bad kv_dtype or a scale without one is a rejection check: a kernel declaring some
    format must reject it; one declaring none is never asked."""
    declaring = Capabilities.declared({"kv_dtypes": ["int8"]})
    undeclared = Capabilities.declared(None)
    for pipeline in (ScorePipeline(kv_dtype="float4"), ScorePipeline(k_scale=0.5)):
        assert declaring.unsupported_kv(pipeline, (4, 2, 4, 16)) is None
        assert undeclared.unsupported_kv(pipeline, (4, 2, 4, 16)) == NO_KV_REASON
    malformed = ScorePipeline(kv_dtype="int8", v_scale=mx.zeros((3, 3)))  # no granularity: the kernel rejects it
    assert declaring.unsupported_kv(malformed, (4, 2, 4, 16)) is None
    assert undeclared.unsupported_kv(malformed, (4, 2, 4, 16)) == kv_reason("int8")
    assert declaring.unsupported_kv(ScorePipeline(), (4, 2, 4, 16)) is None  # unquantized


def test_v2_and_kv_reasons_are_both_named():
    case = _case("int8").with_(sinks=mx.zeros(4))
    reason = _unsupported(Capabilities.declared(None), case)
    assert reason == ("sinks (declare sinks=True in pagecheck_capabilities); " + kv_reason("int8"))
    assert kv_formats_in(reason) == ("int8", "kv_dtypes")
    assert kv_formats_in("sinks (declare sinks=True in pagecheck_capabilities)") is None


def test_the_implementation_skips_an_undeclared_quantized_call():
    impl = load("tests.torch_impls:kv_e4m3_tensor_only")
    with pytest.raises(pytest.skip.Exception, match=r"KV format int8 \(declare kv_dtypes"):
        _case("int8").run(impl)
    with pytest.raises(pytest.skip.Exception, match=r"k_scale per head, v_scale per token"):
        impl.require_case(_case("float8_e4m3fn"))
    assert impl.supports(_case("float8_e4m3fn", k="tensor", v="tensor"))


# -- bridges -------------------------------------------------------------------------------

def _spy(seen, framework="torch"):
    def kernel(query, key_pages, value_pages, block_table, context_lens, page_size, **options):
        seen.update(key_pages=key_pages, value_pages=value_pages, **options)
        if framework == "numpy":
            return np.zeros(query.shape)
        return torch.zeros(query.shape, dtype=query.dtype) if framework == "torch" else mx.zeros_like(query)
    return kernel


@pytest.mark.parametrize("kv_dtype", list(KV_DTYPES))
def test_torch_bridge_hands_the_codes_in_torchs_own_dtype(kv_dtype):
    seen = {}
    case = _case(kv_dtype, k="head", v="token")
    case.run(from_torch(_spy(seen), kv_dtypes=[kv_dtype], kv_scales=["head", "token"]))
    for name in ("key_pages", "value_pages"):
        t = seen[name]
        assert t.dtype == TORCH_DTYPES[kv_dtype], (name, t.dtype)
        raw = t.view(torch.uint8 if kv_dtype != "int8" else torch.int8).numpy()
        np.testing.assert_array_equal(raw, np.array(getattr(case, name)))  # a view: the very codes
    assert seen["kv_dtype"] == kv_dtype
    for name in ("k_scale", "v_scale"):
        s = seen[name]
        assert isinstance(s, torch.Tensor) and s.dtype == torch.float32, (name, s)
        np.testing.assert_array_equal(s.numpy(), np.array(getattr(case, name)))


def test_torch_bridge_hands_a_float_scale_as_a_0d_tensor_and_leaves_a_missing_one_out():
    seen = {}
    case = _case("float8_e4m3fn", k="tensor").with_(k_scale=0.25, v_scale=None)
    case.run(from_torch(_spy(seen), kv_dtypes=["float8_e4m3fn"]))
    assert seen["k_scale"].shape == () and seen["k_scale"].dtype == torch.float32 and float(seen["k_scale"]) == 0.25
    assert "v_scale" not in seen


def test_torch_bridge_never_widens_codes_or_scales():
    seen = {}
    case = _case("float8_e5m2", k="tensor", v="head", dtype="float16")
    case.run(from_torch(_spy(seen), kv_dtypes=["float8_e5m2"], kv_scales=["tensor", "head"], widens_to="float32"))
    assert seen["key_pages"].dtype == torch.float8_e5m2 and seen["v_scale"].dtype == torch.float32


def test_torch_bridge_leaves_pools_that_break_the_contract_as_they_are():
    """A rejection check's float pools under a kv_dtype reach the kernel in their own dtype."""
    seen = {}
    case = _case("float8_e4m3fn")
    bad = case.with_(key_pages=mx.zeros(case.key_pages.shape, dtype=mx.bfloat16))
    bad.run(from_torch(_spy(seen), kv_dtypes=["float8_e4m3fn"], kv_scales=list(GRANULARITIES)))
    assert seen["key_pages"].dtype == torch.bfloat16 and seen["value_pages"].dtype == torch.float8_e4m3fn


def test_kv_dtype_names_rename_the_format_for_the_kernel():
    seen = {}
    fn = from_torch(_spy(seen), kv_dtypes=["float8_e4m3fn"], kv_scales=list(GRANULARITIES),
                    kv_dtype_names={"float8_e4m3fn": "fp8_e4m3"})
    _case("float8_e4m3fn").run(fn)
    assert seen["kv_dtype"] == "fp8_e4m3" and seen["key_pages"].dtype == torch.float8_e4m3fn
    assert Capabilities.declared({"kv_dtype_names": {"int8": "int8"}}).converted


def test_numpy_bridge_hands_the_codes_and_float32_scales():
    for kv_dtype, want in (("float8_e5m2", np.uint8), ("int8", np.int8)):
        seen = {}
        case = _case(kv_dtype, k="tensor", v="token").with_(k_scale=0.5)
        case.run(from_numpy(_spy(seen, "numpy"), kv_dtypes=[kv_dtype], kv_scales=["tensor", "token"]))
        assert seen["key_pages"].dtype == want and seen["kv_dtype"] == kv_dtype
        assert seen["k_scale"].dtype == np.float32 and seen["k_scale"].shape == () and seen["k_scale"] == 0.5
        np.testing.assert_array_equal(seen["v_scale"], np.array(case.v_scale))


def test_mlx_bridge_passes_everything_as_given():
    seen = {}
    case = _case("int8", k="head", v="token")
    case.run(from_mlx(_spy(seen, "mlx"), kv_dtypes=["int8"], kv_scales=list(GRANULARITIES),
                      lse_convention="base2"))  # a convention: the contract's signature, through the bridge
    assert seen["key_pages"] is case.key_pages and seen["k_scale"] is case.k_scale and seen["kv_dtype"] == "int8"


@pytest.mark.parametrize("layout", list(kv.SLOT_MAJOR) + ["hnd", "kv_last"])
def test_native_layout_puts_a_per_token_scale_in_its_slot_order(layout):
    case = _case("int8", k="token", v="head")
    packed = kv.pack_scale(layout, case.k_scale, tuple(case.key_pages.shape))
    P, hkv, ps = case.key_pages.shape[:3]
    assert tuple(packed.shape) == ((P, ps, hkv) if layout in kv.SLOT_MAJOR else (P, hkv, ps))
    caches = kv.pack(layout, case.key_pages, case.value_pages)
    cache = caches.get("key_cache", caches.get("kv_cache"))
    assert cache.shape[1:3] == packed.shape[1:3] or layout == "kv_nhd" and cache.shape[2:4] == packed.shape[1:3]
    np.testing.assert_array_equal(np.array(kv.unpack_scale(layout, packed)), np.array(case.k_scale))  # NaN too
    assert kv.pack_scale(layout, case.v_scale, tuple(case.key_pages.shape)) is case.v_scale  # per head: as is


def test_a_malformed_token_scale_has_no_slot_major_image():
    """Transposed, a [P, ps, Hkv] scale would become the NHD layout's valid shape: a
    rejected call made valid. It is a skip with the reason instead."""
    case = _case("int8", k="token")
    wrong = case.k_scale.swapaxes(1, 2)  # [P, ps, Hkv]: not the contract's [P, Hkv, ps]
    with pytest.raises(NotExpressible, match="no faithful image in layout nhd"):
        kv.pack_scale("nhd", wrong, tuple(case.key_pages.shape))
    assert kv.pack_scale("hnd", wrong, tuple(case.key_pages.shape)) is wrong  # the kernel rejects it


@pytest.mark.parametrize("layout", list(format_impls.KV_LAYOUTS))
@pytest.mark.parametrize("kv_dtype", list(KV_DTYPES))
def test_every_layout_reads_quantized_pools_through_its_converters(kv_dtype, layout):
    """Each layout's float64 reference (written from the layout's definition, the token
    scales in its slot order) matches the oracles on a quantized pool: the converters
    move the codes and the scales consistently."""
    fn = getattr(format_impls, format_impls.KV_LAYOUTS[layout])
    for k, v in (("token", "token"), ("head", "tensor")):
        case = _case(kv_dtype, k=k, v=v, page_size=16)
        failures = compare(case.run(fn), case.args(), case.kwargs()).failures()
        assert not failures, (layout, k, v, failures)


def test_torch_native_kernel_decodes_its_fp8_caches_itself():
    """The NHD / varlen / flash torch kernel decodes the fp8 caches with torch (`.float()`):
    the dtype the bridge hands is the format, or the values differ."""
    for kv_dtype in KV_DTYPES:
        case = _case(kv_dtype, k="token", v="token", dtype="float32")
        failures = compare(case.run(torch_impls.kv_nhd_varlen_flash), case.args(), case.kwargs()).failures()
        assert not failures, (kv_dtype, failures)


# -- the kv catalog through --impl (child pytest per kernel) -------------------------------

def test_torch_reference_passes_the_kv_catalog(tmp_path):
    """The float64 torch reference, handed torch's own fp8 dtypes, passes the kv catalog and
    the quantized hand fixtures (special codes: subnormals, the largest, NaN and inf)."""
    proc, record = run_catalog("tests.torch_impls:kv_reference", tmp_path,
                               [*CATALOG, "tests/test_hand_fixtures_kv.py"])
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert record["capabilities"]["framework"] == "torch" and record["counts"]["passed"] >= 200, record["counts"]
    reasons = {c["message"] for c in record["checks"] if c["outcome"] == "skipped"}
    assert all("bitwise_batch" in r for r in reasons), reasons  # only the bitwise invariants it does not promise
    hand = [c for c in record["checks"] if c["id"].startswith("tests/test_hand_fixtures_kv.py")]
    assert len(hand) >= 9 and all(c["outcome"] == "passed" for c in hand), hand
    for fmt in KV_DTYPES:
        row = record["kv_formats"][fmt]
        assert row["declared"] and row["checks"] >= 72 and row["skipped"] == 0, row
        assert 0 < row["quantization_error"] == record["quantization_error"][fmt], row
        assert row["kernel_error"] < row["quantization_error"], row  # the kernel's error is not the rounding's
    md = (tmp_path / "conformance.md").read_text()
    assert "## Quantized KV pages" in md and "quantization error (max abs)" in md
    assert "<h2>Quantized KV pages (REFERENCE.md 1b)</h2>" in (tmp_path / "conformance.html").read_text()


# the checks each misreading shows on (a -k filter keeps each child run short)
MISREAD_SHOWS_ON = {"kv_v_scale_twice": "meets and float32", "kv_e5m2_as_e4m3": "meets and e5m2",
                    "kv_head_scale_by_query_head": "meets and head-head",
                    "kv_token_scale_logical": "meets and token-token"}


@pytest.mark.parametrize("name", sorted(torch_impls.KV_BROKEN))
def test_kv_misreading_kernel_fails_at_kv_format(name, tmp_path):
    proc, record = run_catalog(f"tests.torch_impls:{name}", tmp_path, [*CATALOG, "-x", "-k", MISREAD_SHOWS_ON[name]])
    assert proc.returncode == 1, proc.stdout[-4000:]
    failed = [c for c in record["checks"] if c["outcome"] == "failed"]
    assert failed and all("kv_format" in c["clauses"] for c in failed), failed
    assert "vs float64" in failed[0]["message"], failed[0]["message"]  # the oracles caught it, not a crash


def test_kernel_declaring_no_kv_format_gets_skips_never_failures(tmp_path):
    """The torch v2 reference declares no KV format: handed fp8 pages it would compute
    garbage, so every quantized check must be a skip naming the format."""
    proc, record = run_catalog("tests.torch_impls:v2_reference", tmp_path, CATALOG)
    assert proc.returncode == 0, proc.stdout[-4000:]
    checks = record["checks"]
    assert checks and all(c["outcome"] == "skipped" for c in checks), record["counts"]
    for fmt in KV_DTYPES:
        named = [c for c in checks if kv_formats_in(c["message"]) == (fmt, "kv_dtypes")]
        assert named and all(fmt in c["id"] for c in named)
        assert record["kv_formats"][fmt] == {"declared": False, "scales": [], "skipped": len(named),
                                             "skipped_scales": 0, "checks": 0, "kernel_error": None,
                                             "share_of_allowance": None, "quantization_error": None}
    assert all(kv_formats_in(c["message"]) or "bitwise_batch" in c["message"] for c in checks)
    assert record["quantization_error"] == {}
    assert "KV formats declared: none" in (tmp_path / "conformance.md").read_text()


def test_partial_declaration_runs_what_it_declares_and_skips_the_rest(tmp_path):
    proc, record = run_catalog("tests.torch_impls:kv_e4m3_tensor_only", tmp_path, [*CATALOG, "-k", "meets"])
    assert proc.returncode == 0, proc.stdout[-4000:]
    by_outcome = {}
    for c in record["checks"]:
        by_outcome.setdefault(c["outcome"], []).append(c)
    ran = {c["id"].split("[")[1].split("-")[0] for c in by_outcome["passed"]}
    assert ran == {"float8_e4m3fn"}
    assert all(("tensor-tensor" in c["id"] or "float-none" in c["id"]) for c in by_outcome["passed"])
    rows = record["kv_formats"]
    assert rows["float8_e4m3fn"]["scales"] == ["tensor"] and rows["float8_e4m3fn"]["skipped_scales"] == 4 * 3 * 4
    assert rows["float8_e5m2"]["skipped"] == rows["int8"]["skipped"] == 6 * 3 * 4
    assert rows["float8_e4m3fn"]["checks"] == 2 * 3 * 4 and rows["float8_e5m2"]["checks"] == 0


# -- repro and report ----------------------------------------------------------------------

def test_a_failed_quantized_check_replays_its_format_and_scales(tmp_path):
    case = _case("float8_e5m2", k="head", v="token", dtype="float32")
    impl = load("tests.torch_impls:kv_e5m2_as_e4m3")
    written = repro.write(repro.Call(case.args(), case.kwargs()), tmp_path / "repro", nodeid="tests/x.py::kv",
                          impl=impl, clauses=("kv_format",), message="e5m2 read as e4m3")
    assert written.path, written.note
    data = np.load(tmp_path / written.path.replace(".py", ".npz"))
    assert str(data["key_pages__dtype"]) == "uint8" and str(data["v_scale__dtype"]) == "float32"
    assert data["v_scale"].shape == tuple(case.v_scale.shape)
    text = (tmp_path / written.path).read_text()
    assert "kv_dtype='float8_e5m2'" in text and "k_scale=k_scale" in text
    failing = run_script(tmp_path / written.path)
    assert failing.returncode == 1 and "FAIL" in failing.stdout, failing.stdout + failing.stderr
    fixed = run_script(tmp_path / written.path, "--impl", "tests.torch_impls:kv_reference")
    assert fixed.returncode == 0 and "PASS" in fixed.stdout, fixed.stdout + fixed.stderr


def test_report_shows_formats_skips_and_the_quantization_error_apart():
    rec = Recorder()
    reasons = [kv_reason("int8"), kv_reason("int8"), kv_reason("float8_e4m3fn", [("v_scale", "token")]),
               NO_KV_REASON]
    for i, reason in enumerate(reasons):
        rec.outcomes[f"tests/t.py::s{i}"] = Outcome(f"tests/t.py::s{i}", "skipped", (), f"not declared by X: {reason}")
    verdict = types.SimpleNamespace(error=0.002, allowed=0.01, relative=0.001)
    rec.errors.record_kv("float8_e4m3fn", verdict, 0.125)
    rec.errors.record_kv("float8_e4m3fn", types.SimpleNamespace(error=0.001, allowed=0.01, relative=0.0), 0.25)
    doc = report.build(load("tests.torch_impls:kv_e4m3_tensor_only"), rec, 0)
    rows = doc.data["kv_formats"]
    assert rows["float8_e4m3fn"] == {"declared": True, "scales": ["tensor"], "skipped": 0, "skipped_scales": 1,
                                     "checks": 2, "kernel_error": 0.002, "share_of_allowance": 0.2,
                                     "quantization_error": 0.25}
    assert rows["int8"]["skipped"] == 2 and not rows["int8"]["declared"] and rows["int8"]["kernel_error"] is None
    assert doc.data["quantization_error"] == {"float8_e4m3fn": 0.25}
    md = report.markdown(doc)
    assert "KV formats declared: float8_e4m3fn (scales: tensor)" in md
    assert "| float8_e4m3fn | yes | tensor | 0 | 1 | 2 | 2.000e-03 | 20% | 2.500e-01 |" in md
    assert "| int8 | no | - | 2 | 0 | 0 | - | - | - |" in md
    lines = report.terminal_lines(doc)
    assert any(x.startswith("KV formats declared: float8_e4m3fn (tensor); not declared: float8_e5m2 (0 checks "
                            "skipped), int8 (2 checks skipped)") for x in lines), lines
    assert any("kernel error 2.000e-03, quantization error 2.500e-01" in x for x in lines), lines
