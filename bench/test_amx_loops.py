"""bench/amx_loops.cpp, the bf16 tile decode's two loops alone (bench/notes/vllm-peer.md "bf16 decode on AMX"):
it builds with the kernels' own tile header and reports every variant with a rate.
Rates are the figures, not judged here (a shared machine); where the CPU or Linux gives no
tile state the program says so and exits 2, and the run is skipped with that reason."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

import impl

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("scores+gathers", "scores", "scores+transpose", "scores-pipelined", "pack", "scores+pack")


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    if shutil.which("g++") is None:
        pytest.skip("no g++ to build bench/amx_loops.cpp")
    exe = tmp_path_factory.mktemp("amx_loops") / "amx_loops"
    subprocess.run(["g++", "-O2", "-march=native", "-std=c++20", "-I", str(ROOT / "impl" / "csrc"),
                    str(ROOT / "bench" / "amx_loops.cpp"), "-o", str(exe)], check=True)
    return exe


def test_every_variant_reports_a_rate(program):
    run = subprocess.run([str(program), "8"], capture_output=True, text=True, timeout=120)
    if run.returncode == 2:
        assert not impl.amx_supported(), f"the kernels have tiles here, amx_loops does not: {run.stdout}"
        pytest.skip(run.stdout.strip())
    assert run.returncode == 0, run.stdout + run.stderr
    rates = dict(re.findall(r"^(\S+)\s+([0-9.]+) GB/s$", run.stdout, re.M))
    assert tuple(rates) == VARIANTS, run.stdout
    assert all(float(r) > 0 for r in rates.values()), run.stdout
