"""bench/walk_model.cpp, the bf16 tile decode's walk of the pool as a model on 2 threads
(bench/notes/decode-from-dram.md "The walk with the decode's work"): it builds with the
kernels' own tile header and reports every variant with a rate. Rates are the figures, not
judged here (a shared machine); where the CPU or Linux gives no tile state the program says
so and exits 2, and the run is skipped with that reason."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from bench.test_amx_loops import assert_every_variant_rated

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("loads", "loads+asks", "walk", "walk+work", "walk+work-asks", "walk+work+gather", "linear")


def test_every_variant_reports_a_rate(tmp_path):
    if shutil.which("g++") is None:
        pytest.skip("no g++ to build bench/walk_model.cpp")
    exe = tmp_path / "walk_model"
    subprocess.run(["g++", "-O2", "-march=native", "-std=c++20", "-pthread", "-I", str(ROOT / "impl" / "csrc"),
                    str(ROOT / "bench" / "walk_model.cpp"), "-o", str(exe)], check=True)
    run = subprocess.run([str(exe), "16", "1"], capture_output=True, text=True, timeout=120)  # 16 MiB, 1 round
    assert_every_variant_rated(run, VARIANTS)
    # Its asking variants ask (its only prefetches): GCC 12 dropped every ask of its first version.
    if shutil.which("objdump") is None:
        pytest.skip("no objdump to read walk_model's code")
    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(exe)], capture_output=True, text=True,
                             check=True).stdout
    assert re.search(r"\bprefetcht[012]\b", listing), "walk_model asks for nothing: its asking variants do not ask"
