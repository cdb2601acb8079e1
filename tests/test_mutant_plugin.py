"""The seeded-mutant catalog as pytest items (mutants/plugin.py): one item a mutant, judged by
the runner's engine in the worker's own scratch copy, results gathered across xdist workers
into the runner's JSON; a survivor, an invalid mutant, a catalog error or a failing baseline
fails its item, a mutant of code this machine cannot run is skipped with the reason."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from mutants.catalog import load
from mutants.runner import summary

ROOT = Path(__file__).resolve().parent.parent
ALLOCATOR = (ROOT / "impl/allocator.py").read_text()
ALLOCATOR_LINE = next(line.strip() for line in ALLOCATOR.splitlines()
                      if line.strip().startswith("def ") and ALLOCATOR.count(line.strip()) == 1)

# Stands in for the runner's Worker: each mutant's status is the first word of its `breaks`,
# the baseline fails when PAGECHECK_FAKE_BASELINE names a test; AMX counts as missing.
FAKE = '''
import os
import mutants.plugin as plugin

class FakeWorker:
    def __init__(self, index, base, files, build_jobs):
        pass
    def baseline(self, killers, impl=None):
        return os.environ.get("PAGECHECK_FAKE_BASELINE") or None
    def run(self, m):
        status = m.breaks.split()[0]
        why = {"killed": "t::x", "invalid": "does not compile: x.h:1: error"}.get(status)
        return {"id": m.id, "status": status, "killed_by": why,
                "seconds": 0.0, "file": m.file, "breaks": m.breaks}

plugin.Worker = FakeWorker
plugin.lacking = lambda: {"amx": True, "triton": False}
'''


def mutant(mid: str, breaks: str, original: str = ALLOCATOR_LINE, needs: str | None = None) -> str:
    return (f'[[mutant]]\nid = "{mid}"\nfile = "impl/allocator.py"\noriginal = {json.dumps(original)}\n'
            f'replacement = "pass"\nbreaks = "{breaks}"\nkillers = ["tests/test_allocator.py"]\n'
            + (f'needs = "{needs}"\n' if needs else ""))


def run(args: list[str], tmp_path: Path, env: dict | None = None) -> tuple[subprocess.CompletedProcess, dict | None]:
    out = tmp_path / "mutants.json"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "mutants.plugin", "-q", "-rfs",
                           "--mutants-json", str(out), *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]), **(env or {})},
                          timeout=600)
    return proc, json.loads(out.read_text()) if out.exists() else None


def fake_run(tmp_path: Path, catalog: str, *extra: str, env: dict | None = None):
    (tmp_path / "fakeworker.py").write_text(FAKE)
    (tmp_path / "fake.toml").write_text(catalog)
    return run(["-p", "fakeworker", str(tmp_path / "fake.toml"), *extra], tmp_path, env)


def test_each_mutant_is_one_item_named_by_its_id():
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "mutants.plugin", "mutants/catalog", "--collect-only",
                           "-q"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ids = [line.split("::")[1] for line in proc.stdout.splitlines() if "::" in line]
    assert sorted(ids) == sorted(m.id for m in load())
    natives = [m.native for m in sorted(load(), key=lambda m: ids.index(m.id))]
    assert natives == sorted(natives, reverse=True)  # native mutants first: their builds are the slow part


def test_real_mutants_over_two_xdist_workers_write_the_runners_report(tmp_path):
    """Two Python mutants of the catalog, judged for real by two workers (each its own scratch copy).
    Python ones: a C++ mutant costs its worker a first build of the kernels (40 s here)."""
    chosen = ["validation-stale-metadata", "validation-type"]
    proc, report = run(["mutants/catalog/validation.toml", "-n", "2", "--mutants-no-baseline",
                        "-k", " or ".join(chosen)], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2/2 mutants killed" in proc.stdout
    assert sorted(r["id"] for r in report["mutants"]) == chosen
    assert all(r["status"] == "killed" and r["killed_by"].startswith("tests/test_rejections.py") for r in report["mutants"])
    assert report == summary(report["mutants"], [], report["seconds"])  # the runner's format, whole


def test_every_outcome_of_an_item(tmp_path):
    catalog = (mutant("m-killed", "killed by a test") + mutant("m-survived", "survived nothing fails")
               + mutant("m-invalid", "invalid code") + mutant("m-amx", "killed on tiles", needs="amx")
               + mutant("m-gone", "killed", original="no such snippet anywhere"))
    proc, report = fake_run(tmp_path, catalog)
    assert proc.returncode == 1
    out = proc.stdout
    assert "1 passed" in out and "3 failed" in out and "1 skipped" in out, out
    assert "m-survived (impl/allocator.py) not killed: survived: no test failed" in out
    assert "m-invalid (impl/allocator.py) not killed: invalid: does not compile: x.h:1: error" in out
    assert "m-gone (impl/allocator.py) not killed: m-gone: its original snippet occurs 0 times" in out
    assert "SKIPPED [1] " in out and "no AMX tiles on this machine" in out
    statuses = {r["id"]: r["status"] for r in report["mutants"]}
    assert statuses == {"m-killed": "killed", "m-survived": "survived", "m-invalid": "invalid",
                        "m-amx": "not applicable"}
    assert report["catalog_errors"] == ["m-gone: its original snippet occurs 0 times in impl/allocator.py "
                                        "(must be exactly once)"]
    assert (report["total"], report["killed"], report["not_applicable"]) == (4, 1, 1)


def test_a_failing_baseline_fails_every_judged_item(tmp_path):
    catalog = mutant("m-one", "killed") + mutant("m-two", "killed")
    proc, report = fake_run(tmp_path, catalog, env={"PAGECHECK_FAKE_BASELINE": "tests/test_x.py::test_y"})
    assert proc.returncode == 1 and "2 failed" in proc.stdout, proc.stdout
    for mid in ("m-one", "m-two"):  # each item's own failure (CI=true also prints whole summary lines)
        assert f"mutant {mid} (impl/allocator.py) not killed: the unmutated tree fails tests/test_x.py::test_y" \
            in proc.stdout, proc.stdout
    proc, report = fake_run(tmp_path, catalog, "--mutants-no-baseline",
                            env={"PAGECHECK_FAKE_BASELINE": "tests/test_x.py::test_y"})
    assert proc.returncode == 0 and report["killed"] == 2, proc.stdout


def test_a_duplicate_id_across_files_is_a_usage_error(tmp_path):
    (tmp_path / "fakeworker.py").write_text(FAKE)
    for name in ("a.toml", "b.toml"):
        (tmp_path / name).write_text(mutant("m-same", "killed"))
    proc, report = run(["-p", "fakeworker", str(tmp_path / "a.toml"), str(tmp_path / "b.toml")], tmp_path)
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert re.search(r"mutant id m-same in [ab]\.toml and [ab]\.toml", proc.stderr), proc.stderr
    assert report is None
