"""A failed check becomes a standalone reproduction (conformance/repro.py): with
`--report-dir DIR` each failed check that called the implementation gets
`DIR/repro/<check>.py` (+ `.npz`: the failing input, the float64 oracle's answer, the
allowance), the report lists failures first with that path, and the script exits 1 on
the kernel that failed and 0 on a correct one (`--impl`).

The catalog runs in a child pytest (tests/test_plugin.py's `run_catalog`) on a few
files, one per broken kernel of tests/plugin_impls.py; each script runs in a child
Python with only the repository on PYTHONPATH.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from conformance import load, repro, report
from conformance.plugin import Outcome, Recorder
from fixtures import paged_case
from tests.test_plugin import ROOT, run_catalog


def run_script(path, *args) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, str(path), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def _failed(record) -> dict:
    return {c["id"]: c for c in record["checks"] if c["outcome"] == "failed"}


@pytest.fixture(scope="module")
def window_run(tmp_path_factory):
    """A window one key too long: hand fixtures and the hypothesis oracle property fail."""
    out = tmp_path_factory.mktemp("window")
    (out / "repro").mkdir()
    (out / "repro" / "stale_from_an_earlier_run.py").write_text("raise SystemExit(1)\n")
    proc, record = run_catalog("tests.plugin_impls:window_one_too_many", out,
                               ["tests/test_hand_fixtures.py",
                                "tests/test_properties.py::test_kernel_matches_float64_oracle"])
    assert proc.returncode == 1, proc.stdout[-4000:]
    return out, proc, record


@pytest.fixture(scope="module")
def clamped_run(tmp_path_factory):
    """Out-of-pool page ids clamped: the rejection checks of page ids fail (accepted)."""
    out = tmp_path_factory.mktemp("clamped")
    proc, record = run_catalog("tests.plugin_impls:page_ids_clamped", out, ["tests/test_rejections.py"])
    assert proc.returncode == 1, proc.stdout[-4000:]
    return out, proc, record


def test_every_failed_check_gets_a_repro(window_run):
    out, _, record = window_run
    failed = _failed(record)
    assert len(failed) >= 2 and "tests/test_properties.py::test_kernel_matches_float64_oracle" in failed
    for check in failed.values():
        assert check["repro"] and check["repro"].startswith("repro/"), check
        script = out / check["repro"]
        assert script.is_file() and script.with_suffix(".npz").is_file(), script
        assert check["id"] in script.read_text()  # the script names its check
    assert not (out / "repro" / "stale_from_an_earlier_run.py").exists()  # an earlier run's repro is gone
    assert len(list((out / "repro").glob("*.py"))) == len(failed)
    passed = [c for c in record["checks"] if c["outcome"] == "passed"]
    assert passed and all("repro" not in c for c in passed)


def test_report_lists_failures_first_with_their_repro(window_run):
    out, proc, record = window_run
    md, page = (out / "conformance.md").read_text(), (out / "conformance.html").read_text()
    assert md.index("## Failures") < md.index("## Checks by area")
    assert page.index("<h2>Failures</h2>") < page.index("<h2>Checks by area</h2>")
    summary = proc.stdout[proc.stdout.index("pagecheck verification summary"):]
    assert summary.index("Failures:") < summary.index("area ")
    for check in _failed(record).values():
        path = check["repro"]
        assert f"[{path}]({path})" in md[:md.index("## Checks by area")]
        assert f'<a href="{path}">' in page
        assert str(out / path) in summary  # the terminal gives the full path


def test_hypothesis_repro_is_the_shrunk_example_and_fails_until_fixed(window_run):
    out, _, record = window_run
    script = out / _failed(record)["tests/test_properties.py::test_kernel_matches_float64_oracle"]["repro"]
    data = np.load(script.with_suffix(".npz"))
    assert data["query"].size <= 64, data["query"].shape  # shrunk, not the first random layout
    text = script.read_text()
    assert "layout={" in text and "attention=Implementation" not in text  # drawn arguments, not fixtures
    proc = run_script(script)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    m = re.search(r"max \|out - ref\| = (\S+)\s+allowed (\S+)", proc.stdout)
    assert m and float(m.group(1)) > float(m.group(2)), proc.stdout
    assert "NaN in the output: 0 of" in proc.stdout and "FAIL" in proc.stdout
    fixed = run_script(script, "--impl", "tests.plugin_impls:float64_oracle")
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert "PASS" in fixed.stdout and "kernel: tests.plugin_impls:float64_oracle" in fixed.stdout


def test_hand_fixture_repro_runs_standalone(window_run):
    out, _, record = window_run
    check = next(c for i, c in _failed(record).items() if "test_hand_fixture[window_family" in i)
    script = out / check["repro"]
    proc = run_script(script)
    assert proc.returncode == 1 and "allowed" in proc.stdout and "requests off" in proc.stdout, proc.stdout
    builtin = run_script(script, "--impl", "impl:paged_attention")
    assert builtin.returncode == 0, builtin.stdout + builtin.stderr


def test_rejection_repro_fails_while_the_input_is_accepted(clamped_run):
    out, _, record = clamped_run
    failed = _failed(record)
    high = next(c for i, c in failed.items() if i.endswith("[page-id-high]"))
    script = out / high["repro"]
    assert 'EXPECT = \'reject\'' in script.read_text()
    proc = run_script(script)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "accepted" in proc.stdout and "[page_id] block_table[0, 2] = 999 is outside the pool" in proc.stdout
    builtin = run_script(script, "--impl", "impl:paged_attention")
    assert builtin.returncode == 0 and "PASS: rejected with ContractViolation" in builtin.stdout, builtin.stdout
    oracle = run_script(script, "--impl", "tests.plugin_impls:float64_oracle")
    assert oracle.returncode == 2 and "validates_input=False" in oracle.stdout, oracle.stdout


def test_rejection_repro_names_the_wrong_error_type(tmp_path):
    proc, record = run_catalog("tests.plugin_impls:asserts_on_bad_input", tmp_path,
                               ["tests/test_rejections.py::test_invariant_10_rejection_leaves_inputs_and_outputs_untouched"])
    assert proc.returncode == 1, proc.stdout[-4000:]
    check = next(c for i, c in _failed(record).items() if i.endswith("[query-f64]"))
    script = tmp_path / check["repro"]
    run = run_script(script)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "raised AssertionError" in run.stdout and "not one of the declared error types" in run.stdout
    assert run_script(script, "--impl", "impl:paged_attention").returncode == 0


# -- without a child pytest --------------------------------------------------------------

def _case():
    return paged_case(context_lens=[7, 0], query_len=2, q_heads=4, kv_heads=2, head_dim=8, page_size=4, seed=3,
                      window=3, dtype="bfloat16")


def test_recorder_keeps_the_last_call():
    log = repro.CallLog()
    log.record((1,), {"a": 1})
    log.record((2,), {"b": 2})
    assert log.last == repro.Call((2,), {"b": 2})
    log.clear()
    assert log.last is None
    case = _case()
    impl = load("tests.plugin_impls:float64_oracle")
    repro.CALLS.clear()
    recorded = repro.recording(impl.fn)
    case.run(recorded)
    case.with_(window=None).run(recorded)
    assert repro.CALLS.last.kwargs["window"] is None and repro.CALLS.last.args[0] is case.query
    wrapped = repro.recording(impl.fn)
    assert wrapped.pagecheck_capabilities == impl.fn.pagecheck_capabilities


def test_calls_a_script_cannot_restate_are_said_so(tmp_path):
    def kernel(*args, **kwargs):
        return None

    kernel.packed = lambda *args, **kwargs: "packed"
    wrapped = repro.recording(kernel)
    repro.CALLS.clear()
    assert wrapped.packed(1, 2) == "packed"
    impl = load("tests.plugin_impls:float64_oracle")
    note = repro.write(repro.CALLS.last, tmp_path, nodeid="tests/test_x.py::test_mixed", impl=impl).note
    assert "packed varlen call" in note
    assert "no call" in repro.write(None, tmp_path, nodeid="tests/test_x.py::test_y", impl=impl).note
    assert not list(tmp_path.iterdir())


def test_size_cap_holds(tmp_path):
    case = _case()
    call = repro.Call(case.args(), case.kwargs())
    impl = load("tests.plugin_impls:window_one_too_many")
    capped = repro.write(call, tmp_path / "repro", nodeid="tests/test_x.py::test_y[big]", impl=impl,
                         max_bytes=1000)
    assert not capped.path and "not written" in capped.note and "cap" in capped.note
    assert not (tmp_path / "repro").exists()
    written = repro.write(call, tmp_path / "repro", nodeid="tests/test_x.py::test_y[big]", impl=impl)
    assert written.path == "repro/test_x__test_y_big.py"
    data = np.load(tmp_path / "repro" / "test_x__test_y_big.npz")
    assert str(data["query__dtype"]) == "bfloat16" and data["query"].dtype == np.float32
    assert data["expected"].dtype == np.float64 and float(data["allowed"]) > 0
    # the 4 GiB fixture's pools, lazily: MLX allocates nothing until evaluated
    huge = mx.zeros((2 ** 15, 2, 128, 128), dtype=mx.bfloat16)
    big = repro.write(repro.Call((case.query, huge, huge) + case.args()[3:], case.kwargs()), tmp_path / "r2",
                      nodeid="tests/test_x.py::test_huge", impl=impl)
    assert not big.path and "GiB" in big.note and "64.0 MiB cap" in big.note
    rec = Recorder()
    rec.outcomes["tests/test_x.py::test_huge"] = Outcome("tests/test_x.py::test_huge", "failed", (), "boom",
                                                         repro_note=big.note)
    doc = report.build(impl, rec, 1)
    assert big.note in report.markdown(doc) and doc.data["checks"][0]["repro"] is None
    assert doc.data["checks"][0]["repro_note"] == big.note


def test_report_puts_failures_first(tmp_path):
    rec = Recorder()
    rec.outcomes["tests/test_x.py::ok"] = Outcome("tests/test_x.py::ok", "passed", ())
    rec.outcomes["tests/test_x.py::bad"] = Outcome("tests/test_x.py::bad", "failed", ("window",), "off by one",
                                                   repro="repro/test_x__bad.py")
    doc = report.build(load("tests.plugin_impls:window_one_too_many"), rec, 1)
    md, page = report.markdown(doc), report.to_html(doc)
    assert md.index("## Failures") < md.index("## Checks by area")
    assert "| tests/test_x.py::bad | [window] " in md and "[repro/test_x__bad.py](repro/test_x__bad.py)" in md
    assert page.index("<h2>Failures</h2>") < page.index("<h2>Checks by area</h2>")
    assert '<a href="repro/test_x__bad.py">' in page
    lines = report.terminal_lines(doc, tmp_path)
    text = "\n".join(lines)
    assert text.index("Failures:") < text.index("area ") and str(tmp_path / "repro/test_x__bad.py") in text
    assert doc.data["checks"][1]["repro"] == "repro/test_x__bad.py"


def test_two_call_checks_say_what_the_repro_cannot_show(tmp_path):
    case = _case()
    written = repro.write(repro.Call(case.args(), case.kwargs()), tmp_path / "repro", impl=load(None),
                          nodeid="tests/test_invariants.py::test_invariant_6_batch_invariance[5]", clauses=("inv6",),
                          statement="A request's bits do not depend on its neighbours.")
    text = (tmp_path / written.path).read_text()
    assert "TWO_CALLS = True" in text and "needs both calls" in text and "its neighbours" in text
    assert "last call only" in written.note
    assert "IMPL = 'impl:paged_attention'" in text and "ERROR_TYPES = ('ContractViolation',)" in text
    proc = run_script(tmp_path / written.path)
    assert proc.returncode == 0 and "compared two calls" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.parametrize("nodeid,stem", [
    ("tests/test_a.py::test_b[window_family[w=1]]", "test_a__test_b_window_family_w_1"),
    ("tests/test_a.py::test_b[page-id-high]", "test_a__test_b_page-id-high"),
    ("tests/test_a.py::TestC::test_d", "test_a__TestC__test_d"),
])
def test_file_names_are_safe(nodeid, stem):
    assert repro.file_name(nodeid) == stem
    long = repro.file_name("tests/test_a.py::test_b[" + "x" * 300 + "]")
    assert len(long) <= 100 and long != repro.file_name("tests/test_a.py::test_b[" + "x" * 299 + "]")


def _v2_call():
    case = _case().with_(window=None, softcap=20.0, alibi_slopes=mx.array([0.5, 0.25, 0.125, 1.0]),
                         sinks=mx.array([1.0, -2.0, 0.5, 3.0]), return_lse=True)
    return repro.Call(case.args(), case.kwargs())


@pytest.mark.parametrize("name,off", [("sinks_ignored", "max |out - ref|"), ("lse_base2_undeclared", "lse: max")])
def test_a_v2_call_with_its_arrays_and_lse_is_reproduced(name, off, tmp_path):
    """A failed contract-v2 call (slopes, sinks, return_lse): the arrays go into the .npz
    beside the oracle's out and lse, and the script judges both; a correct kernel passes it."""
    impl = load(f"tests.plugin_impls:{name}")
    written = repro.write(_v2_call(), tmp_path / "repro", nodeid=f"tests/test_x.py::test_v2[{name}]", impl=impl,
                          clauses=("sinks", "lse"))
    assert written.path, written.note
    script = tmp_path / written.path
    data = np.load(script.with_suffix(".npz"))
    assert str(data["alibi_slopes__dtype"]) == "float32" and data["sinks"].shape == (4,)
    assert data["expected_lse"].shape == (2, 4, 2) and np.isneginf(data["expected_lse"][1]).all()
    assert float(data["allowed_lse"]) > 0 and float(data["allowed"]) > 0
    text = script.read_text()
    assert "alibi_slopes=alibi_slopes" in text and "sinks=sinks" in text and "return_lse=True" in text
    assert "softcap=20.0" in text and "judged against the oracle's lse" in text
    proc = run_script(script)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAIL" in proc.stdout and off in proc.stdout and "lse: max |lse - ref|" in proc.stdout, proc.stdout
    for fixed in ("tests.plugin_impls:float64_oracle_v2", "impl:paged_attention"):
        run = run_script(script, "--impl", fixed)
        assert run.returncode == 0, (fixed, run.stdout + run.stderr)
        assert "PASS" in run.stdout and "empty rows not -inf: 0" in run.stdout


def test_a_rejected_v2_option_is_a_rejection_repro(tmp_path):
    case = _case().with_(sinks=mx.array([1.0, 2.0]))  # [2], not [Hq] = [4]
    call = repro.Call(case.args(), case.kwargs())
    assert repro.contract_violation(call).startswith("[sinks] ")
    written = repro.write(call, tmp_path / "repro", nodeid="tests/test_x.py::test_sinks_shape", impl=load(None))
    assert "EXPECT = 'reject'" in (tmp_path / written.path).read_text()
    assert run_script(tmp_path / written.path).returncode == 0  # the built-in rejects it
    assert repro.contract_violation(repro.Call(case.args(), {**case.kwargs(), "sinks": None})) is None
