"""The `--impl` plug-in path (conformance/): a correct foreign implementation passes, each
deliberately broken one (tests/plugin_impls.py) fails at the clause it breaks, bad
`--impl` values and declarations are clear usage errors, and the NumPy adapter keeps
the contract's boundary.

The catalog runs in a child pytest per implementation (as a user runs it); the report's
JSON record (`--report-dir`) says which checks failed and the clauses they point at.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from conformance import Capabilities, UsageError, from_numpy, load
from contract import ScorePipeline
from conformance.clauses import CLAUSES
from tests.plugin_impls import BROKEN

ROOT = Path(__file__).resolve().parent.parent
OPERATOR_CHECKS = ["tests/test_hand_fixtures.py", "tests/test_invariants.py", "tests/test_rejections.py"]


def run_catalog(impl: str, out: Path, files=("tests",)) -> tuple[subprocess.CompletedProcess, dict | None]:
    env = dict(os.environ, HYPOTHESIS_PROFILE="ci")
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "correctness and not slow", "--impl", impl,
           "--report-dir", str(out), *files]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    record = out / "conformance.json"
    return proc, json.loads(record.read_text()) if record.exists() else None


def test_float64_oracle_passes_the_whole_catalog(tmp_path):
    proc, record = run_catalog("tests.plugin_impls:float64_oracle", tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert record["verdict"] == "PASS" and not record["builtin"]
    counts = record["counts"]
    assert counts.get("failed", 0) == 0 and counts["passed"] >= 150, counts
    reasons = {c["message"] for c in record["checks"] if c["outcome"] == "skipped"}
    assert all(r.startswith(("built-in only:", "not declared by tests.plugin_impls:float64_oracle")) for r in reasons), reasons
    assert any("validates_input" in r for r in reasons) and any("bitwise_threads" in r for r in reasons)
    ran = {c["id"].split("::")[0] for c in record["checks"] if c["outcome"] == "passed"}
    for area in ("test_hand_fixtures", "test_differential", "test_invariants", "test_properties", "test_edges"):
        assert f"tests/{area}.py" in ran, f"{area} did not run for a foreign implementation"
    md = (tmp_path / "conformance.md").read_text()
    assert "tests.plugin_impls:float64_oracle" in md and "| float32 | float64 |" in md
    assert "<table>" in (tmp_path / "conformance.html").read_text()


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_implementation_fails_at_its_clause(name, tmp_path):
    clause = BROKEN[name]
    proc, record = run_catalog(f"tests.plugin_impls:{name}", tmp_path, OPERATOR_CHECKS)
    assert proc.returncode == 1, proc.stdout[-4000:]
    assert record["verdict"] == "FAIL"
    failed = [c for c in record["checks"] if c["outcome"] == "failed"]
    pointing = [c["id"] for c in failed if clause in c["clauses"]]
    assert pointing, f"{name} breaks {clause}; failures point at {[(c['id'], c['clauses']) for c in failed]}"
    assert f"[{clause}] {CLAUSES[clause]}" in (tmp_path / "conformance.md").read_text()
    assert "contract clause" in proc.stdout  # the terminal failure shows the clause too


def test_declared_limits_skip_with_the_reason(tmp_path):
    proc, record = run_catalog("tests.plugin_impls:float64_oracle_decode_f32", tmp_path, ["tests/test_hand_fixtures.py"])
    assert proc.returncode == 0, proc.stdout[-4000:]
    skipped = [c for c in record["checks"] if c["outcome"] == "skipped"]
    assert any("dtype bfloat16" in c["message"] for c in skipped)
    assert any("declared prefill=False" in c["message"] for c in skipped)
    assert record["counts"]["passed"] > 0


@pytest.mark.parametrize("spec,message", [
    ("tests.plugin_impls", r"expected MODULE:ATTR"),
    ("no_such_module_xyz:fn", r"cannot import module 'no_such_module_xyz'"),
    ("tests.plugin_impls:no_such_fn", r"has no attribute 'no_such_fn'"),
    ("tests.plugin_impls:BROKEN", r"is a dict, not a callable"),
    ("tests.plugin_impls:bad_capabilities", r"unknown capability 'bitwise'"),
])
def test_bad_impl_is_a_usage_error(spec, message):
    with pytest.raises(UsageError, match=message):
        load(spec)


def test_bad_impl_on_the_command_line_is_one_clear_line(tmp_path):
    proc, _ = run_catalog("no_such_module_xyz:fn", tmp_path, ["tests/test_oracles.py"])
    assert proc.returncode == 4
    assert "cannot import module 'no_such_module_xyz'" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("spec,message", [
    ({"dtypes": ["float64"]}, r"not among"), ({"prefill": "yes"}, r"must be True or False"),
    ({"bitwise_threads": True}, r"needs a callable set_num_threads"), ({"error_types": [42]}, r"exception classes"),
    ([1], r"must be a dict"),
])
def test_bad_capabilities_are_rejected(spec, message):
    with pytest.raises(ValueError, match=message):
        Capabilities.declared(spec)


def test_undeclared_implementation_gets_the_whole_contract_but_bitwise():
    caps = Capabilities.declared(None)
    assert caps.unsupported(dtype="bfloat16", head_dim=80, page_size=3, query_len=9,
                            pipeline=ScorePipeline(mask=None)) is None
    assert not caps.bitwise_batch and not caps.bitwise_threads and caps.validates_input


def test_builtin_is_the_default():
    impl = load(None)
    assert impl.builtin and impl.caps.bitwise_batch and impl.caps.bitwise_threads
    assert load("impl:paged_attention").builtin


def test_numpy_adapter_boundary():
    seen = {}

    def kernel(query, key_pages, value_pages, block_table, context_lens, page_size, *, scale, mask, window):
        seen.update(q=query.dtype, table=block_table.dtype, page_size=page_size, mask=mask)
        return np.full(query.shape, 1.0 / 3.0)

    fn = from_numpy(kernel, dtypes=["bfloat16"])
    assert fn.pagecheck_capabilities == {"dtypes": ["bfloat16"], "framework": "numpy", "device": "cpu",
                                         "extra_memory": 4.0 + 2}  # the float32 copy of bf16 pools: 2x
    q = mx.zeros((1, 2, 1, 4), dtype=mx.bfloat16)
    pages = mx.zeros((2, 1, 4, 4), dtype=mx.bfloat16)
    out = fn(q, pages, pages, mx.array([[1]], dtype=mx.int32), mx.array([1], dtype=mx.int32), 4, mask=None)
    assert out.dtype == mx.bfloat16 and out.shape == (1, 2, 1, 4)
    assert seen == {"q": np.float32, "table": np.int32, "page_size": 4, "mask": None}
    with pytest.raises(TypeError, match=r"query must be an mlx.core.array"):
        fn(np.zeros((1, 2, 1, 4)), pages, pages, mx.array([[1]], dtype=mx.int32), mx.array([1], dtype=mx.int32), 4)
    bad = from_numpy(lambda *a, **k: [0.0])
    with pytest.raises(TypeError, match=r"expected a NumPy array"):
        bad(q, pages, pages, mx.array([[1]], dtype=mx.int32), mx.array([1], dtype=mx.int32), 4)


def test_builtin_report_carries_the_mutant_kill_table(tmp_path, monkeypatch):
    from conformance import report
    from conformance.plugin import Outcome, Recorder

    kills = {"total": 2, "killed": 1, "survived": 1, "mutants": [
        {"id": "kernel-gqa-round-robin", "breaks": "GQA | mapping", "status": "killed",
         "killed_by": "tests/test_hand_fixtures.py::test_hand_fixture[gqa_6_to_2]", "seconds": 3.5},
        {"id": "pool-leak", "breaks": "leak", "status": "survived", "killed_by": None, "seconds": 9.0}]}
    (tmp_path / "mutants.json").write_text(json.dumps(kills))
    monkeypatch.setattr(report, "MUTANTS_JSON", tmp_path / "mutants.json")
    monkeypatch.setattr(report, "MUTMUT_JSON", tmp_path / "absent.json")
    rec = Recorder()
    rec.outcomes["tests/test_x.py::a"] = Outcome("tests/test_x.py::a", "failed", ("gqa",), "boom")
    doc = report.build(load(None), rec, 1)
    md = report.markdown(doc)
    assert doc.verdict == "FAIL" and "1/2 killed, 1 survived" in md
    assert "| kernel-gqa-round-robin | GQA \\| mapping | killed |" in md
    assert f"[gqa] {CLAUSES['gqa']}" in md and '<td class="survived">survived</td>' in report.to_html(doc)
    foreign = report.markdown(report.build(load("tests.plugin_impls:float64_oracle"), rec, 1))
    assert "Seeded mutants" not in foreign  # the kill table is about the built-in implementation


def test_report_lists_the_v2_features_and_their_skips():
    from conformance import report
    from conformance.plugin import Outcome, Recorder

    rec = Recorder()
    reasons = ["not declared by X: sinks (declare sinks=True in pagecheck_capabilities)",
               "not declared by X: sinks, lse (declare sinks=True, lse=True in pagecheck_capabilities)",
               "built-in only: checks the pool"]
    for i, reason in enumerate(reasons):
        rec.outcomes[f"tests/test_x.py::s{i}"] = Outcome(f"tests/test_x.py::s{i}", "skipped", (), reason)
    doc = report.build(load("tests.plugin_impls:float64_oracle"), rec, 0)
    assert doc.data["features"]["sinks"] == {"declared": False, "skipped": 2}
    assert doc.data["features"]["lse"] == {"declared": False, "skipped": 1}
    assert doc.data["features"]["softcap"] == {"declared": False, "skipped": 0}
    md = report.markdown(doc)
    assert "contract v2 features declared: none" in md and "| attention sinks | sinks | no | 2 |" in md
    line = next(x for x in report.terminal_lines(doc) if x.startswith("contract v2"))
    assert "not declared: softcap (0 checks skipped), alibi (0 checks skipped), sinks (2 checks skipped)" in line
    v2 = report.build(load("tests.plugin_impls:float64_oracle_v2"), rec, 0)
    assert "contract v2 features declared: softcap, alibi, sinks, lse, value_head_dim" in report.markdown(v2)
