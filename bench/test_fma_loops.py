"""bench/fma_loops.cpp, the FMA path's two loops alone (bench/notes/vllm-peer.md "The FMA path's two loops"),
on float32 and bfloat16 rows: built with the kernels' own flags, it reports every loop at
every working set with a rate (the figures, not judged here: a shared machine), the float32
score loop's machine code loads each K and query vector once per step, and the bfloat16
one widens each K vector with one word permute; the prefill's score loop on transposed
blocks gives the fold's bits with no shuffle and, two blocks at a time, broadcasts each
query element once for both.

| symptom                                                        | caught by |
|----------------------------------------------------------------|-----------|
| GCC folds the K loads into the FMAs (20 loads per 16 FMAs)     | test_score_loop_loads_each_vector_once (native and Zen tuning) |
| scores16_block inlined into attend_chunk, where it spills      | test_score_loop_loads_each_vector_once (no such function) |
| bf16 rows widened by a zero-extension and a shift (two vector ops a load, not one) | test_bf16_rows_widen_with_one_permute |
| the transposed score loop adds a key's partial sums in other pairs than the fold | test_transposed_scores_have_the_fold_bits |
| the transposed score loop shuffles (the fold it exists to remove) | test_transposed_score_loop_has_no_shuffle |
| the two-block transposed loop broadcasts each query element once per block, or folds its K loads into the FMAs (Zen tuning) | test_paired_transposed_loop_broadcasts_once |
| the value loop without asks (the prefill's) reloads its key count from the stack and parks a row pointer in a vector register every key, asks, is merged with the asking loop (Zen tuning), or keeps its accumulators on the stack around the loop | test_value_loop_keeps_its_operands_in_registers |
| the one-block transposed loop (Zen 4's prefill) keeps its pending sums in memory | test_one_block_transposed_loop_keeps_its_sums_in_registers |
"""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from peers import cpu_flags

ROOT = Path(__file__).resolve().parent.parent
# The kernels' flags (CMakeLists.txt: PAGECHECK_OPT_LEVEL, the bitwise flags, PAGECHECK_NATIVE):
# the loop's code is only the kernel's when it is compiled as the kernel is.
KERNEL_FLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-march=native", "-mprefer-vector-width=512"]
SCORE_LOOP = "void pagecheck::scores16_block<pagecheck::{}, 4>("  # .format(element type)
TRANSPOSED_LOOP = "void pagecheck::scores_transposed<4, 1>("
PAIRED_LOOP = "void pagecheck::scores_transposed<4, 2>("
# The value loop without asks for `rows` query rows: a prefill's groups of kWeighRows = 6
# rows that see the same keys, and of 4 (a position's GQA group where spans differ)
VALUE_LOOPS = {rows: f"void pagecheck::weigh_keys<pagecheck::F32, {rows}, 4, false>(" for rows in (4, 6)}
ASKING_VALUE_LOOP = "void pagecheck::weigh_keys<pagecheck::F32, 4, 4, true>("  # a decode's
LOOPS = ("scores", "transposed", "transposed32", "weigh", "weigh_scratch", "weigh6_scratch")
SIZES_KIB = ("32", "512")
# GCC 12 folds the score loop's loads into its FMAs when it tunes for Zen (as -march=native
# does on the AMD machine) and not when it tunes for Sapphire Rapids (the Intel machine), so
# the loop is also compiled with this tuning: the register barrier (lanes.h in_register) is
# checked on every machine, not only where the native tuning happens to fold.
FOLDING_TUNE = "-mtune=znver3"


def build(tmp_path_factory, name: str, *extra: str) -> Path:
    if shutil.which("g++") is None:
        pytest.skip("no g++ to build bench/fma_loops.cpp")
    exe = tmp_path_factory.mktemp(name) / "fma_loops"
    subprocess.run(["g++", *KERNEL_FLAGS, *extra, "-std=c++20", "-I", str(ROOT / "impl" / "csrc"),
                    str(ROOT / "bench" / "fma_loops.cpp"), "-o", str(exe)], check=True, capture_output=True)
    return exe


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    exe = build(tmp_path_factory, "fma_loops")
    probe = subprocess.run([str(exe), "1"], capture_output=True, text=True, timeout=60)
    if probe.returncode == 2:
        pytest.skip(probe.stdout.strip())
    return exe


@pytest.fixture(scope="module")
def output(program):
    """What one run over SIZES_KIB prints (every loop timed; a few seconds)."""
    run = subprocess.run([str(program), *SIZES_KIB], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


def test_every_loop_reports_a_rate(output):
    rates = re.findall(r"^(scores|transposed|transposed32|weigh|weigh_scratch|weigh6_scratch) (f32|bf16) (\d+) KiB ([0-9.]+) GFMA/s$", output, re.M)
    assert [line[:3] for line in rates] == [(loop, dtype, kib) for kib in SIZES_KIB for dtype in ("f32", "bf16")
                                            for loop in LOOPS], output
    assert all(float(line[3]) > 0 for line in rates), output


def test_transposed_scores_have_the_fold_bits(output):
    """Every block's scores from its transposed copy, one block at a time and two, equal
    scores16_rows' bit for bit, f32 and bf16 rows (the prefill's bits, and so invariant
    8, rest on it)."""
    same = re.findall(r"^same bits (f32|bf16) (yes|no)$", output, re.M)
    assert same == [(dtype, "yes") for _ in SIZES_KIB for dtype in ("f32", "bf16")], output


def test_transposed_score_loop_has_no_shuffle(program):
    """scores_transposed<4, 1> is a function of its own whose multiply-adds take each K
    vector from a register and whose fold is vertical adds: no shuffle, permute or unpack
    (the fold it replaces took about 30 a row per 16 keys)."""
    code = score_loop_code(program, loop=TRANSPOSED_LOOP)
    assert code, f"{TRANSPOSED_LOOP}...) is not a function of its own in the build (inlined?)"
    fmas = [line for line in code if re.search(r"\bvfmadd\d+ps\b", line)]
    assert len(fmas) >= 8, "\n".join(code)
    shuffles = [line for line in code if re.search(r"\bv(shuf|perm|unpck|pshuf|align)\w*", line)]
    assert not shuffles, "shuffles in the transposed score loop:\n" + "\n".join(shuffles)
    k_from_memory = [line for line in fmas if "(%" in line and "{1to16}" not in line]
    assert not k_from_memory, "multiply-adds that load a K vector:\n" + "\n".join(k_from_memory)


@pytest.mark.parametrize("tuning", ["native", "zen"])
def test_paired_transposed_loop_broadcasts_once(tuned, tuning):
    """scores_transposed<4, 2>, the prefill's loop, broadcasts each query element once for
    both blocks (8 broadcasts for 16 FMAs: 12 loads a step, not 20) and takes every
    operand of its multiply-adds from registers, under the native tuning and under Zen's,
    which folds the K loads into the FMAs where the register barrier is missing."""
    code = score_loop_code(tuned, loop=PAIRED_LOOP)
    assert code, f"{PAIRED_LOOP}...) is not a function of its own in the build (inlined?)"
    fmas = [line for line in code if re.search(r"\bvfmadd\d+ps\b", line)]
    assert len(fmas) >= 16, "\n".join(code)
    from_memory = [line for line in fmas if "(%" in line]
    assert not from_memory, "multiply-adds that load their operand:\n" + "\n".join(from_memory)
    broadcasts = [line for line in code if re.search(r"\bvbroadcastss\b", line)]
    assert 2 * len(broadcasts) <= len(fmas), "\n".join(code)


@pytest.mark.parametrize("tuning", ["native", "zen"])
def test_one_block_transposed_loop_keeps_its_sums_in_registers(tuned, tuning):
    """scores_transposed<4, 1>, the prefill's loop one block at a time (Zen 4's: transposed.h),
    holds every pending partial sum in a register: no vector goes through the stack (the
    pairs' loop keeps them in memory, where 32 registers would not hold them)."""
    code = score_loop_code(tuned, loop=TRANSPOSED_LOOP)
    assert code, f"{TRANSPOSED_LOOP}...) is not a function of its own in the build (inlined?)"
    through_stack = [t for t in code if "%zmm" in t and ("(%rsp)" in t or "(%rbp)" in t)]
    assert not through_stack, "vectors through the stack:\n" + "\n".join(through_stack)


def loops_of(code: list[str]) -> list[list[str]]:
    """The instructions of every loop in `code` (objdump lines of one function): from the
    target of each backward jump to the jump."""
    parsed = []
    for line in code:
        address, _, text = line.partition(":")
        parsed.append((int(address, 16), text.strip()))
    starts = {address: i for i, (address, _) in enumerate(parsed)}
    loops = []
    for i, (address, text) in enumerate(parsed):
        jump = re.match(r"j\w+\s+([0-9a-f]+)\b", text)
        if jump and int(jump.group(1), 16) <= address and int(jump.group(1), 16) in starts:
            loops.append([t for _, t in parsed[starts[int(jump.group(1), 16)]:i + 1]])
    return loops


@pytest.mark.parametrize("rows", sorted(VALUE_LOOPS))
@pytest.mark.parametrize("tuning", ["native", "zen"])
def test_value_loop_keeps_its_operands_in_registers(tuned, tuning, rows):
    """weigh_keys<F32, rows, 4, false>, the prefill's value loop (its V rows sit in scratch;
    6 rows where they see the same keys, 24 accumulators, 4 V vectors and a broadcast in
    29 of the 32 registers), asks for nothing, and every loop over the keys of 4 x rows
    multiply-adds in it needs nothing from the stack and no row pointer parked in a vector
    register, under the native tuning and Zen's; its twin with asks (a decode's, 4 rows)
    asks. With the test of `next` inside one loop, GCC reloaded the key count from the
    stack and moved a row pointer out of a vector register every key, and the prefill's
    value loop ran behind its score loop (bench/notes/status-log.md "The f32 prefill on the Intel machine");
    two loops in one function were merged back into that one under Zen's tuning. Its
    accumulators stay in registers from the first load to the last store: with its loops
    over them not unrolled, GCC set them up and stored them through the stack (16 stores
    and 16 loads a call of 256 multiply-adds; AMD, one thread: 2.0-2.5 against 2.6-3.1
    GFMA/s)."""
    loop = VALUE_LOOPS[rows]
    code = score_loop_code(tuned, loop=loop)
    assert code, f"{loop}...) is not a function of its own in the build (inlined?)"
    assert not any("prefetch" in t for t in code), "the value loop without asks asks:\n" + "\n".join(code)
    # The loop over the keys: the shortest with 4 x rows multiply-adds (a backward jump
    # that joins two paths of the function also spans one, with whatever lies around it).
    fmas = 4 * rows
    key_loops = [body for body in loops_of(code) if sum(bool(re.search(r"\bvfmadd\d+ps\b", t)) for t in body) == fmas]
    assert key_loops, f"no loop of {fmas} multiply-adds:\n" + "\n".join(code)
    key_loop = min(key_loops, key=len)
    spills = [t for t in key_loop if "(%rsp)" in t or "(%rbp)" in t or re.search(r"\bvmovq\b", t)]
    assert not spills, "the value loop without asks spills:\n" + "\n".join(key_loop)
    through_stack = [t for t in code if "%zmm" in t and ("(%rsp)" in t or "(%rbp)" in t)]
    assert not through_stack, "accumulators through the stack:\n" + "\n".join(through_stack)
    asking = score_loop_code(tuned, loop=ASKING_VALUE_LOOP)
    assert any("prefetch" in t for t in asking), f"{ASKING_VALUE_LOOP}...) asks for nothing"


def score_loop_code(exe: Path, element: str = "F32", loop: str = SCORE_LOOP) -> list[str]:
    """The instructions of `loop` (scores16_block<element, 4> by default) in `exe`, or []
    where it has no such function."""
    if shutil.which("objdump") is None:
        pytest.skip("no objdump to read the score loop's code")
    listing = subprocess.run(["objdump", "-d", "-C", "--no-show-raw-insn", str(exe)], capture_output=True,
                             text=True, check=True).stdout
    body, inside = [], False
    for line in listing.splitlines():
        if line.endswith(">:"):
            inside = loop.format(element) in line
        elif inside and line.strip():
            body.append(line)
    return body


@pytest.fixture(scope="module")
def folding_program(tmp_path_factory, program):
    """The same program tuned for Zen (FOLDING_TUNE), where GCC folds loads into FMAs;
    built only to be read, never run (its code runs here anyway: tuning picks no ISA)."""
    return build(tmp_path_factory, "fma_loops_zen", FOLDING_TUNE)


@pytest.fixture
def tuned(request, tuning):
    """The program of a test's tuning. The Zen-tuned one is built only when a test of that
    tuning runs: a mutant's killer, the native case alone, compiles one program, not two."""
    return request.getfixturevalue("program" if tuning == "native" else "folding_program")


@pytest.mark.parametrize("tuning", ["native", "zen"])
def test_score_loop_loads_each_vector_once(tuned, tuning):
    """Every multiply-add of the score loop takes its K and query vectors from registers:
    each is loaded once per d step (4 + 4 loads per 16 FMAs), not once per FMA (20), and
    the loop is a function of its own, as the kernel calls it (inlined into attend_chunk,
    its 29 live vectors spilled). Under the native tuning and under Zen's: on the Intel
    machine the native one never folds, with the barrier or without."""
    code = score_loop_code(tuned)
    assert code, f"{SCORE_LOOP.format('F32')}...) is not a function of its own in the build (inlined?)"
    fmas = [line for line in code if re.search(r"\bvfmadd\d+ps\b", line)]
    assert len(fmas) >= 16, "\n".join(code)
    from_memory = [line for line in fmas if "(%" in line]
    assert not from_memory, "multiply-adds that load their operand:\n" + "\n".join(from_memory)


def test_bf16_rows_widen_with_one_permute(program):
    """A bfloat16 K vector becomes float32 by one masked word permute (each element to the
    high half of its lane, zeros below), not a zero-extension and a shift: on the AMD
    machine the second op made a bf16 decode slower than a float32 one (B 1 S 1024 pages
    of 16, 2 threads, 0.179 -> 0.137-0.178 ms with one op; README). Same values: exact."""
    if "avx512bw" not in cpu_flags():
        pytest.skip("no AVX512-BW here: the widening keeps its shift")
    code = score_loop_code(program, "BF16")
    assert code, f"{SCORE_LOOP.format('BF16')}...) is not a function of its own in the build"
    permutes = [line for line in code if re.search(r"\bvpermw\b", line)]
    shifts = [line for line in code if re.search(r"\b(vpslld|vpmovzxwd)\b", line)]
    assert len(permutes) >= 4 and not shifts, "\n".join(code)
