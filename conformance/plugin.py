"""pytest plugin (loaded by conftest.py): the implementation under test and the record
the conformance report is written from.

| piece                       | what it does                                                  |
|-----------------------------|---------------------------------------------------------------|
| `--impl MODULE:ATTR`        | the callable checked (default: the built-in kernel)           |
| `--report-dir DIR`          | also write DIR/conformance.md, .html and .json, and DIR/repro/<check>.py (+ .npz) per failed check (conformance/repro.py) |
| fixture `attention`         | the `Implementation` under test (session scope)               |
| fixture `error_log`         | worst error against each oracle per dtype, and per KV format the kernel's error beside the quantization's own (`record_kv`), for the report |
| marker `builtin_only(why)`  | a check of pagecheck's own pool / scheduler / kernel internals: skipped, with `why`, for another implementation |
| marker `clause(*ids)`       | the contract clauses a check checks (conformance/clauses.py); a failure shows their text |
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from fixtures.bits import Bits, explain

from . import repro as _repro
from . import report as _report
from .clauses import describe
from .implementation import UsageError, load

_STATE = {"impl": None}


@dataclass
class ErrorLog:
    """Worst |error|, relative error and share of the allowance per (dtype, oracle); per
    KV format (`kv`) the same for the kernel against the float64 oracle on the dequantized
    pages, and apart from it the worst error the quantization itself adds against the
    unquantized K/V (oracles.quantization_error): the kernel's error is judged, the
    quantization's is reported."""

    worst: dict = field(default_factory=dict)
    kv: dict = field(default_factory=dict)  # format -> KVErrors

    def record(self, dtype, against: str, verdict) -> None:
        key = (str(dtype).removeprefix("mlx.core."), against)
        err, rel, share = self.worst.get(key, (0.0, 0.0, 0.0))
        self.worst[key] = (max(err, verdict.error), max(rel, verdict.relative), max(share, _share(verdict)))

    def record_kv(self, kv_dtype: str, verdict, quantization_error: float) -> None:
        """One quantized check: the kernel's verdict against float64 and the quantization
        error of its call (from the float case it was quantized from)."""
        was = self.kv.get(kv_dtype, KVErrors())
        self.kv[kv_dtype] = KVErrors(checks=was.checks + 1, kernel=max(was.kernel, verdict.error),
                                     share=max(was.share, _share(verdict)),
                                     quantization=max(was.quantization, float(quantization_error)))


@dataclass(frozen=True)
class KVErrors:
    checks: int = 0  # quantized checks that recorded
    kernel: float = 0.0  # worst max |out - ref|, ref over the dequantized pages
    share: float = 0.0  # worst share of the allowance
    quantization: float = 0.0  # worst max |ref over dequantized - ref over unquantized|


def _share(verdict) -> float:
    return verdict.error / verdict.allowed if verdict.allowed else float("inf")


@dataclass
class Outcome:
    nodeid: str
    outcome: str  # passed | failed | skipped
    clauses: tuple
    message: str = ""
    seconds: float = 0.0
    repro: str = ""  # failed: its reproduction script, relative to the report directory
    repro_note: str = ""  # why none was written, or what it cannot show


class Recorder:
    def __init__(self):
        self.outcomes: dict[str, Outcome] = {}
        self.errors = ErrorLog()

    def add(self, item, rep) -> None:
        if rep.when != "call" and rep.outcome == "passed":
            return
        previous = self.outcomes.get(rep.nodeid)
        if previous is not None and previous.outcome != "passed":
            return  # keep the first failure or skip of a test (setup, call, teardown)
        outcome = "failed" if rep.outcome == "failed" else rep.outcome
        self.outcomes[rep.nodeid] = Outcome(rep.nodeid, outcome, _clauses(item), _message(rep),
                                            getattr(rep, "duration", 0.0))


RECORDER = Recorder()


def _clauses(item) -> tuple:
    return tuple(c for mark in item.iter_markers("clause") for c in mark.args)


def _message(rep) -> str:
    if rep.outcome == "skipped":
        text = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        # a skip subclass (formats' NotExpressible) is shown with its class name: the reason alone
        return text.removeprefix("Skipped: ").removeprefix("conformance.formats.errors.NotExpressible: ")
    if rep.outcome == "failed":
        crash = getattr(rep.longrepr, "reprcrash", None)
        return crash.message if crash is not None else str(rep.longrepr).splitlines()[-1]
    return ""


def current():
    return _STATE["impl"]


def pytest_addoption(parser):
    group = parser.getgroup("pagecheck")
    group.addoption("--impl", default=None, metavar="MODULE:ATTR",
                    help="check this paged-attention callable (default: the built-in kernel)")
    group.addoption("--report-dir", default=None, metavar="DIR",
                    help="write the conformance report to DIR/conformance.md and .html")


def pytest_configure(config):
    config.addinivalue_line("markers", "builtin_only(why): checks pagecheck's own internals; "
                                       "skipped for another implementation")
    config.addinivalue_line("markers", "clause(*ids): contract clauses the check checks")
    try:
        impl = load(config.getoption("impl"))
    except UsageError as e:
        raise pytest.UsageError(str(e)) from None
    # tests call `attention(...)` and, for rejections, the plain `attention.fn(...)`: both record
    _STATE["impl"] = dataclasses.replace(impl, fn=_repro.recording(impl.fn))
    out = config.getoption("report_dir")
    if out and not hasattr(config, "workerinput"):  # repro files of an earlier run are stale
        for old in (Path(out) / "repro").glob("*"):
            if old.suffix in (".py", ".npz") and old.is_file():
                old.unlink()


def pytest_report_header(config):
    impl = current()
    return [f"pagecheck implementation under test: {impl.name}",
            f"declared capabilities: {impl.caps.summary()}"]


@pytest.fixture(scope="session")
def attention():
    """The implementation under test (conformance.implementation.Implementation)."""
    return current()


@pytest.fixture(scope="session")
def error_log() -> ErrorLog:
    return RECORDER.errors


def pytest_collection_modifyitems(config, items):
    impl = current()
    for item in items:
        for clause in _clauses(item):
            describe(clause)  # an unknown clause id is a collection error, not a silent label
        mark = item.get_closest_marker("builtin_only")
        if mark is not None and not impl.builtin:
            why = mark.args[0] if mark.args else "pagecheck's own internals"
            item.add_marker(pytest.mark.skip(reason=f"built-in only: checks {why}"))


@pytest.hookimpl(tryfirst=True)
def pytest_assertrepr_compare(op, left, right):
    # Two bits() values: where they differ, never pytest's quadratic diff of the bytes
    # (fixtures/bits.py: 76 s for 16 KiB of a wrong output under CI or -v).
    if op == "==" and isinstance(left, Bits) and isinstance(right, Bits):
        return explain(left, right)
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _repro.CALLS.clear()  # each check records its own calls


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    result = yield
    rep = result.get_result()
    repro = None
    if rep.failed:
        clauses = _clauses(item)
        if clauses:
            rep.sections.append(("contract clause", "\n".join(describe(c) for c in clauses)))
        out = item.config.getoption("report_dir")
        if out and rep.when == "call":
            repro = _write_repro(item, rep, Path(out))
            if repro.path:
                rep.sections.append(("pagecheck repro", f"python {Path(out) / repro.path}"
                                     + (f"  ({repro.note})" if repro.note else "")))
        elif out:
            repro = _repro.Repro(note=f"none: the check failed in its {rep.when}")
    before = RECORDER.outcomes.get(rep.nodeid)
    RECORDER.add(item, rep)
    outcome = RECORDER.outcomes.get(rep.nodeid)
    if repro is not None and outcome is not None and outcome is not before:  # this report made the outcome
        outcome.repro, outcome.repro_note = repro.path, repro.note
    if rep.when == "teardown":
        _repro.CALLS.clear()  # let the check's arrays go


def _write_repro(item, rep, out: Path):
    doc = getattr(getattr(item, "function", None), "__doc__", None) or ""
    statement = doc.strip().split("\n\n")[0]
    try:
        return _repro.write(_repro.CALLS.last, out / "repro", nodeid=rep.nodeid, impl=current(),
                            clauses=_clauses(item), statement=statement,
                            message=_repro.short_message(_message(rep), getattr(item, "fixturenames", ())))
    except Exception as e:  # noqa: BLE001 - a repro that cannot be written must not hide the failure
        return _repro.Repro(note=f"not written: {type(e).__name__}: {e}")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not RECORDER.outcomes:
        return
    doc = _report.build(current(), RECORDER, exitstatus)
    tr = terminalreporter
    tr.section("pagecheck verification summary")
    out = config.getoption("report_dir")
    for line in _report.terminal_lines(doc, Path(out) if out else None):
        tr.line(line)
    if out:
        paths = _report.write(doc, Path(out))
        tr.line("report: " + ", ".join(str(p) for p in paths))

