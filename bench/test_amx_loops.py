"""bench/amx_loops.cpp, the bf16 tile decode's two loops alone (bench/notes/vllm-peer.md "bf16 decode on AMX"):
it builds with the kernels' own tile header and reports every variant with a rate.
Rates are the figures, not judged here (a shared machine); where the CPU or Linux gives no
tile state the program says so and exits 2, and the run is skipped with that reason.

The tile walk's own code (impl/csrc/amx_walk.cpp), compiled as the kernels are but for
Sapphire Rapids (so on any x86 machine, tiles or not): its asking loops ask and the others
do not. GCC 12 once dropped every ask of the walk without a word (a call of `Ahead::ask` it
judged free of side effects), and nothing else notices: the asks change no value."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

import impl
from bench.test_fma_loops import KERNEL_FLAGS, score_loop_code

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


def assert_every_variant_rated(run: subprocess.CompletedProcess, variants: tuple[str, ...]) -> None:
    """A tile program's run printed a positive rate for each of `variants`, in order; where it
    found no tiles (exit 2) the kernels have none either, and the test is skipped."""
    if run.returncode == 2:
        assert not impl.amx_supported(), f"the kernels have tiles here, {run.args[0]} does not: {run.stdout}"
        pytest.skip(run.stdout.strip())
    assert run.returncode == 0, run.stdout + run.stderr
    rates = dict(re.findall(r"^(\S+)\s+([0-9.]+) GB/s$", run.stdout, re.M))
    assert tuple(rates) == variants, run.stdout
    assert all(float(r) > 0 for r in rates.values()), run.stdout


def test_every_variant_reports_a_rate(program):
    assert_every_variant_rated(subprocess.run([str(program), "8"], capture_output=True, text=True, timeout=120),
                               VARIANTS)


# The walk's loops, by whether they ask (amx_chunk.h: pack_keys, pack_values<kAsks>). A decode's
# key_scores reads K by tile loads alone and asks for nothing: pack_values asks for the next
# item's K lines beside its V lines, two of each a step (Ahead::kpool).
WALK_LOOPS = ("pack_keys", "pack_values")
SILENT_LOOP = "<pagecheck::tiles::key_scores("  # not a template: objdump names no return type
VALUE_ASKS = 4
TILE_MARCH = "-march=sapphirerapids"  # AMX and AVX512-BF16: the tile path's code on any x86 build host


def test_walk_asks_in_its_code(tmp_path):
    if shutil.which("g++") is None or shutil.which("objdump") is None:
        pytest.skip("no g++ and objdump to read the tile walk's code")
    obj = tmp_path / "amx_walk.o"
    flags = [f for f in KERNEL_FLAGS if not f.startswith("-march=")] + [TILE_MARCH]
    build = subprocess.run(["g++", *flags, "-std=c++20", "-I", str(ROOT / "impl" / "csrc"), "-c",
                            str(ROOT / "impl" / "csrc" / "amx_walk.cpp"), "-o", str(obj)], capture_output=True, text=True)
    if build.returncode != 0 and "sapphirerapids" in build.stderr:
        pytest.skip(f"this g++ does not know {TILE_MARCH}")
    assert build.returncode == 0, build.stderr
    asks = {}
    for loop in WALK_LOOPS:
        for kind in ("true", "false"):
            code = score_loop_code(obj, loop=f"void pagecheck::tiles::{loop}<{kind}>(")
            assert code, f"{loop}<{kind}> is not a function of its own in amx_walk.o"
            asks[(loop, kind)] = sum(bool(re.search(r"\bprefetcht[012]\b", t)) for t in code)
    silent = [loop for loop in WALK_LOOPS if asks[(loop, "true")] == 0]
    assert not silent, f"the asking walk's loops ask for nothing: {silent}"
    assert asks[("pack_values", "true")] >= VALUE_ASKS, \
        f"pack_values<true> asks {asks[('pack_values', 'true')]} times: not for the next item's K lines beside its V lines"
    key_code = score_loop_code(obj, loop=SILENT_LOOP)
    assert key_code, "key_scores is not a function of its own in amx_walk.o"
    assert not any(re.search(r"\bprefetcht[012]\b", t) for t in key_code), "key_scores asks between its tile loads"
    asking = [loop for loop in WALK_LOOPS if asks[(loop, "false")] > 0]
    assert not asking, f"the walk's loops without asks ask: {asking}"
