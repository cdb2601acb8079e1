"""bench/fma_loops.cpp, the float32 FMA path's two loops alone (README "The FMA path's two
loops"): built with the kernels' own flags, it reports every loop at every working set with
a rate (the figures, not judged here: a shared machine), and the score loop's machine code
loads each K and query vector once per step.

| symptom                                                        | caught by |
|----------------------------------------------------------------|-----------|
| GCC folds the K loads into the FMAs (20 loads per 16 FMAs)     | test_score_loop_loads_each_vector_once |
| scores16_block inlined into attend_chunk, where it spills      | test_score_loop_loads_each_vector_once (no such function) |
"""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The kernels' flags (CMakeLists.txt: PAGECHECK_OPT_LEVEL, the bitwise flags, PAGECHECK_NATIVE):
# the loop's code is only the kernel's when it is compiled as the kernel is.
KERNEL_FLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-march=native", "-mprefer-vector-width=512"]
SCORE_LOOP = "void pagecheck::scores16_block<pagecheck::F32, 4>("
SIZES_KIB = ("32", "512")


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    if shutil.which("g++") is None:
        pytest.skip("no g++ to build bench/fma_loops.cpp")
    exe = tmp_path_factory.mktemp("fma_loops") / "fma_loops"
    subprocess.run(["g++", *KERNEL_FLAGS, "-std=c++20", "-I", str(ROOT / "impl" / "csrc"),
                    str(ROOT / "bench" / "fma_loops.cpp"), "-o", str(exe)], check=True, capture_output=True)
    probe = subprocess.run([str(exe), "1"], capture_output=True, text=True, timeout=60)
    if probe.returncode == 2:
        pytest.skip(probe.stdout.strip())
    return exe


def test_every_loop_reports_a_rate(program):
    run = subprocess.run([str(program), *SIZES_KIB], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    rates = re.findall(r"^(scores|weigh) (\d+) KiB ([0-9.]+) GFMA/s$", run.stdout, re.M)
    assert [(loop, kib) for loop, kib, _ in rates] == [(loop, kib) for kib in SIZES_KIB
                                                       for loop in ("scores", "weigh")], run.stdout
    assert all(float(rate) > 0 for _, _, rate in rates), run.stdout


def score_loop_code(exe: Path) -> list[str]:
    """The instructions of scores16_block<F32, 4> in `exe`, or [] where it has no such function."""
    if shutil.which("objdump") is None:
        pytest.skip("no objdump to read the score loop's code")
    listing = subprocess.run(["objdump", "-d", "-C", "--no-show-raw-insn", str(exe)], capture_output=True,
                             text=True, check=True).stdout
    body, inside = [], False
    for line in listing.splitlines():
        if line.endswith(">:"):
            inside = SCORE_LOOP in line
        elif inside and line.strip():
            body.append(line)
    return body


def test_score_loop_loads_each_vector_once(program):
    """Every multiply-add of the score loop takes its K and query vectors from registers:
    each is loaded once per d step (4 + 4 loads per 16 FMAs), not once per FMA (20), and
    the loop is a function of its own, as the kernel calls it (inlined into attend_chunk,
    its 29 live vectors spilled)."""
    code = score_loop_code(program)
    assert code, f"{SCORE_LOOP}...) is not a function of its own in the build (inlined?)"
    fmas = [line for line in code if re.search(r"\bvfmadd\d+ps\b", line)]
    assert len(fmas) >= 16, "\n".join(code)
    from_memory = [line for line in fmas if "(%" in line]
    assert not from_memory, "multiply-adds that load their operand:\n" + "\n".join(from_memory)
