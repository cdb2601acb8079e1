"""gpu/h200/ and gpu/h200.sh without a GPU: the measurement run's whole code path on the CPU
(`python -m gpu.h200 --dry-run`: the Triton interpreter, tiny shapes), its compute-sanitizer
case, the shell script's syntax, and its requirement lists against pyproject.toml."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="gpu/h200/ needs torch (the `bridges` extra)")
pytest.importorskip("triton", reason="gpu/h200/ needs triton (its interpreter on the CPU)")

ROOT = Path(__file__).resolve().parents[1]


def _run(*args, timeout=240):
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "gpu.h200", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_dry_run_writes_every_section(tmp_path):
    done = _run("--dry-run", "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "h200.json").read_text())
    assert report["mode"] == "dry-run"
    for key in ("name", "torch", "triton", "sm_count"):
        assert key in report["device"]
    bw = report["bandwidth"]
    assert bw["copy_gbps"] > 0 and bw["read_gbps"] > 0 and bw["copy_gbps"] == pytest.approx(2 * bw["read_gbps"])
    assert report["rows"], "no row was measured"
    kinds = set()
    for row in report["rows"]:
        kinds.add(row["kind"])
        assert row["valid"], row["name"]
        assert row["time_s"] > 0 and row["kernels_time_s"] > 0
        assert set(row["ratio"]) == {"sdpa", "flex"} and row["ratio"]["sdpa"] > 0
        assert row["bandwidth_fraction"]["call"] > 0
        for path in ("ours", "ours_kernels", "sdpa"):
            err = row["error"][path]
            assert err["ok"] and err["max_rel_row"] <= err["tol_rel_row"], (row["name"], path, err)
            assert err["max_abs"] < 0.05, (row["name"], path, err)
        flex = row["paths"]["flex"]
        assert "median_s" in flex or flex["status"].startswith("absent"), flex
        assert row["goal"] is None  # S = 64: no goal
    assert kinds == {"decode", "prefill"}
    # the budget: the interpreter's S=4096 prefill is estimated far past it, skipped with the reason
    assert [s["name"] for s in report["skipped"]] == ["prefill B1 S4096 ps16 bfloat16"]
    assert report["skipped"][0]["reason"].startswith("budget:")
    assert report["goal"]["status"] is None and "dry run" in report["goal"]["note"]
    md = (tmp_path / "h200.md").read_text()
    assert "Skipped rows (1)" in md and "| decode B2 S64 ps16 bfloat16 |" in md and "WRONG" not in md


def test_memcheck_case_passes_on_the_interpreter():
    done = _run("--memcheck-case")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "memcheck case: all ok" in done.stdout


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_script_syntax():
    done = subprocess.run(["bash", "-n", str(ROOT / "gpu" / "h200.sh")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_script_installs_what_pyproject_requires():
    """The wheelhouse and the set-up name every Linux build requirement and the `test` extra."""
    tomllib = pytest.importorskip("tomllib", reason="Python < 3.11")
    script = (ROOT / "gpu" / "h200.sh").read_text()
    listed = set(re.findall(r'"([^"\s]+)"', " ".join(re.findall(r"^[A-Z0-9_]+_REQS=\((.*)\)$", script, re.M))))
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    wanted = [r.split(";")[0].strip() for r in project["build-system"]["requires"] if "darwin" not in r]
    wanted += project["project"]["optional-dependencies"]["test"]
    wanted += [r.split(";")[0].strip() for r in project["project"]["dependencies"] if "darwin" not in r]
    assert not [r for r in wanted if r not in listed], listed
