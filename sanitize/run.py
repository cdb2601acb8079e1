"""Build the C++ core with sanitizers and run its checks under them.

    python -m sanitize asan [--build-dir DIR] [--jobs N] [-- PYTEST_ARGS...]
    python -m sanitize tsan [--build-dir DIR] [--jobs N]
    python -m sanitize fuzz [--seconds N] [--build-dir DIR] [--jobs N] [-- PYTEST_ARGS...]

asan  Configures CMake with -DPAGECHECK_SANITIZE=address (ASan + UBSan, every UB check
      fatal) into build/sanitize-asan, builds `_kernels` (incremental), stages it as the
      package dir build/sanitize-asan/pkg/pagecheck_kernels, and runs ASAN_TESTS (the
      kernel-facing correctness catalog, the write path, test_edges and the bounded
      fuzz examples) with that package first on PYTHONPATH and the ASan runtime preloaded
      into the interpreter (LD_PRELOAD). Only our extension and nanobind are instrumented;
      CPython, NumPy and libmlx are not, so their own bugs are out of scope, but every
      load and store our code makes is checked, wherever the buffer came from.
fuzz  The asan build; runs tests/test_fuzz_boundary.py for --seconds (default 60) of
      fresh random calls (PAGECHECK_FUZZ_SECONDS; seed printed, PAGECHECK_FUZZ_SEED to replay).
tsan  Configures -DPAGECHECK_SANITIZE=thread -DPAGECHECK_BUILD_TESTS=ON into
      build/sanitize-tsan, builds the standalone driver impl/csrc/tests/thread_driver.cpp
      (the kernel sources + the driver only, no nanobind) and runs it through ctest: worker
      counts 1-8 bit for bit, two MLX streams at once, eager calls (paged_attention_now)
      from two threads beside a stream, concurrent parallel_for callers racing a resize,
      the in-place write path.
      Not through Python. TSan preloaded into the interpreter with a TSan-built module
      does run the catalog, but libmlx is not instrumented: the reference counts of MLX's
      shared buffers are atomics TSan cannot see, so when the main thread drops the last
      reference to a buffer a stream thread read, TSan reports the free against the read
      (seen: `mlx::core::allocator::Data` dispose vs `mlx::core::gather`, in one run of
      two). Silencing that would mean suppressing every MLX buffer free, which is exactly
      where a real race of ours (a kernel reading a pool after its release) would show.
      The driver process holds only our code and libmlx, and every buffer it reads is
      kept alive by the driver past the eval that reads it: no such report in 9 runs
      (17 rounds) while this was written.

A run fails (exit status 1) when the tests fail or when any sanitizer report shows up,
in the output or in the sanitizer log files (log_path, kept under <build>/reports).

Runtime options:
  ASAN_OPTIONS  detect_leaks=0       CPython never frees its interned objects at exit:
                                     LeakSanitizer would report the interpreter, not us
                halt_on_error=1      the first report ends the run
  UBSAN_OPTIONS print_stacktrace=1:halt_on_error=1
  TSAN_OPTIONS  halt_on_error=1:second_deadlock_stack=1
  LD_PRELOAD    the runtime, then libstdc++ (see python_env)
pytest runs with -p no:faulthandler (its SIGSEGV handler would hide ASan's report) and
--capture=sys (a report written to fd 2 by a dying process is not lost in a capture file).

Suppressions: sanitize/{asan,ubsan,tsan}.supp are passed when present; each line says
why it is there. ASan + UBSan need none (MLX 0.32.4: no report in our runs). TSan needs
six lines, all inside MLX's Event and its shared state (tsan.supp). Reports in our own code (impl/csrc,
pagecheck::) are never suppressed.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
# The sanitized builds' optimization level (PAGECHECK_OPT_LEVEL): -O1, as both sanitizers'
# documentation advises. Every source-level load and store is instrumented at any level
# (the kernels' vectors are intrinsics: 64-byte accesses either way) and the arithmetic is
# fixed by the other flags, so nothing checked is lost; -O3 only made the build slow: the
# ASan build of decode.cpp took 103 s at -O3 and 25 s at -O1 (AMD Zen 5).
OPT_LEVEL = "-O1"

# The operator tests and the write path: everything that calls into the compiled core.
ASAN_TESTS = [
    "tests/test_differential.py",
    "tests/test_hand_fixtures.py",
    "tests/test_hand_fixtures_kv.py",  # quantized pages: code loads, scales at physical slots
    "tests/test_kv_quant.py",
    "tests/test_invariants.py",
    "tests/test_rejections.py",
    "tests/test_schedules.py",
    "tests/test_golden_bits.py",
    "tests/test_amx.py",  # the tile path: its scratch, packs and row copies
    "tests/test_pool.py",
    "tests/test_pool_quant.py",  # the quantizing slot write and the in-place token scales
    "tests/test_quantize_codes.py",
    "tests/test_cache.py",
    "tests/test_edges.py",
    # the eager entry: lazy inputs waited for, views copied, outputs allocated by it (its
    # catalog run, a child process of the whole catalog, is left to the plain suite)
    "tests/test_now.py::test_now_gives_the_lazy_bits",
    "tests/test_now.py::test_now_waits_for_lazy_inputs",
    "tests/test_now.py::test_now_reads_views_by_value",
    "tests/test_now.py::test_now_output_pins_no_pool",
    "tests/test_fuzz_boundary.py",  # its fixed, derandomized examples (a few seconds)
]
FUZZ_TESTS = ["tests/test_fuzz_boundary.py"]

# Lines any sanitizer prints at the head or the end of a report.
REPORT = re.compile(
    r"ERROR: (Address|Leak)Sanitizer|WARNING: ThreadSanitizer|ThreadSanitizer: reported"
    r"|SUMMARY: (Address|UndefinedBehavior|Thread|Leak)Sanitizer|: runtime error: "
    r"|Sanitizer:DEADLYSIGNAL|FATAL: ThreadSanitizer")


def _say(msg: str) -> None:
    print(f"[sanitize] {msg}", flush=True)


def _run(cmd: list[str], **kwargs) -> None:
    _say(" ".join(str(c) for c in cmd))
    subprocess.run(cmd, check=True, **kwargs)


def configure(build: Path, sanitize: str, tests: bool) -> None:
    """Configures once; later calls only refresh the cache entries (a second or two)."""
    cmd = ["cmake", "-S", str(ROOT), "-B", str(build), f"-DPAGECHECK_SANITIZE={sanitize}",
           f"-DPAGECHECK_BUILD_TESTS={'ON' if tests else 'OFF'}",
           # RelWithDebInfo: -g, and nanobind does not strip the module (it does in Release),
           # so reports name our functions and lines. The kernels' own level comes after.
           "-DCMAKE_BUILD_TYPE=RelWithDebInfo", f"-DPAGECHECK_OPT_LEVEL={OPT_LEVEL}",
           f"-DPython_EXECUTABLE={sys.executable}"]
    if not (build / "CMakeCache.txt").exists() and shutil.which("ninja"):
        cmd += ["-G", "Ninja"]
    _run(cmd, stdout=subprocess.DEVNULL)


def build_target(build: Path, target: str, jobs: int) -> None:
    _run(["cmake", "--build", str(build), "--target", target, "-j", str(jobs)])


def stage(build: Path) -> Path:
    """build/.../pkg/pagecheck_kernels: the built module plus its __init__.py."""
    package = build / "pkg" / "pagecheck_kernels"
    package.mkdir(parents=True, exist_ok=True)
    for old in package.glob("_kernels*.so"):
        old.unlink()
    modules = sorted(build.glob("_kernels*.so"))
    if not modules:
        raise SystemExit(f"no _kernels*.so in {build}")
    for so in modules:
        shutil.copy2(so, package / so.name)
    shutil.copy2(ROOT / "impl" / "csrc" / "pagecheck_kernels_init.py", package / "__init__.py")
    return package.parent


def compiler(build: Path) -> str:
    for line in (build / "CMakeCache.txt").read_text().splitlines():
        if line.startswith("CMAKE_CXX_COMPILER:"):
            return line.split("=", 1)[1]
    return "gcc"


def runtime(build: Path, name: str) -> str:
    """Absolute path of a sanitizer runtime of the compiler that built the module."""
    path = subprocess.run([compiler(build), f"-print-file-name={name}"], check=True,
                          capture_output=True, text=True).stdout.strip()
    if not os.path.isabs(path) or not os.path.exists(path):
        raise SystemExit(f"{compiler(build)} does not know {name} (got {path!r}); install its sanitizer runtime")
    return os.path.realpath(path)


def _options(base: str, supp: str, log_dir: Path | None, prefix: str) -> str:
    opts = base
    if (HERE / supp).exists():
        opts += f":suppressions={HERE / supp}"
    if log_dir is not None:
        opts += f":log_path={log_dir / prefix}"
    return opts


def run_scanned(cmd: list[str], env: dict, log_dir: Path | None) -> int:
    """Runs cmd, echoing its output; 1 if it failed or any sanitizer report appeared."""
    if log_dir is not None:
        shutil.rmtree(log_dir, ignore_errors=True)
        log_dir.mkdir(parents=True)
    _say(" ".join(cmd))
    reports = []
    with subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, errors="replace") as proc:
        for line in proc.stdout:
            sys.stdout.write(line)
            if REPORT.search(line):
                reports.append(line.rstrip())
    rc = proc.returncode
    for log in sorted(log_dir.iterdir()) if log_dir is not None else []:
        text = log.read_text(errors="replace")
        print(f"----- {log} -----\n{text}", flush=True)
        reports += [ln for ln in text.splitlines() if REPORT.search(ln)] or [f"(report in {log})"]
    if reports:
        _say(f"FAIL: {len(reports)} sanitizer report line(s):")
        for line in reports[:20]:
            print(f"    {line}")
        return 1
    if rc != 0:
        _say(f"FAIL: exit status {rc}")
        return 1
    return 0


def python_env(build: Path, package_root: Path, log_dir: Path, extra: dict) -> dict:
    """The interpreter's environment: ASan preloaded, options, staged package first."""
    env = dict(os.environ)
    env.update(extra)
    # libstdc++ right after the runtime: python does not link it, and ASan resolves its
    # __cxa_throw interceptor at start-up; without libstdc++ there, the first C++
    # exception (the entry point's own checks) dies in "CHECK failed: ... real___cxa_throw".
    env["LD_PRELOAD"] = f"{runtime(build, 'libasan.so')}:{runtime(build, 'libstdc++.so')}"
    env["ASAN_OPTIONS"] = _options("detect_leaks=0:halt_on_error=1", "asan.supp", log_dir, "asan")
    env["UBSAN_OPTIONS"] = _options("print_stacktrace=1:halt_on_error=1", "ubsan.supp", log_dir, "ubsan")
    env["PYTHONPATH"] = os.pathsep.join([str(package_root), str(ROOT)])
    # checked by sanitize/plugin.py: the staged module is the one imported, the runtime is loaded
    env["PAGECHECK_SANITIZE_PACKAGE"] = str(package_root / "pagecheck_kernels")
    env["PAGECHECK_SANITIZE_RUNTIME"] = env["LD_PRELOAD"].split(":")[0]
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def pytest_cmd(tests: list[str], extra: list[str]) -> list[str]:
    """Test files or node ids among `extra` replace the default selection."""
    if any(not a.startswith("-") and (ROOT / a.split("::")[0]).exists() for a in extra):
        tests = []
    # no:faulthandler: its SIGSEGV handler would replace ASan's (whose report names the
    # faulting line). --capture=sys: pytest captures Python's sys.stdout/stderr only, so a
    # report the runtime writes to file descriptor 2 (UBSan writes there whatever its
    # log_path says) reaches our scan even when the process dies in the middle of a test.
    return [sys.executable, "-m", "pytest", "-p", "sanitize.plugin", "-p", "no:faulthandler",
            "--capture=sys", "-q", "-m", "correctness and not slow", *tests, *extra]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sanitize", description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=("asan", "tsan", "fuzz"))
    parser.add_argument("--seconds", type=float, default=60.0, help="fuzz: time budget (default 60)")
    parser.add_argument("--build-dir", type=Path, default=None,
                        help="default build/sanitize-asan (asan, fuzz) or build/sanitize-tsan")
    parser.add_argument("--jobs", "-j", type=int, default=2, help="parallel compile jobs (default 2)")
    parser.add_argument("pytest_args", nargs="*", help="after --: passed on to pytest")
    args = parser.parse_args(argv)

    start = time.monotonic()
    if args.kind == "tsan":
        build = (args.build_dir or ROOT / "build" / "sanitize-tsan").resolve()
        configure(build, "thread", tests=True)
        build_target(build, "thread_driver", args.jobs)
        built = time.monotonic()
        env = dict(os.environ)
        env["TSAN_OPTIONS"] = _options("halt_on_error=1:second_deadlock_stack=1", "tsan.supp", None, "tsan")
        cmd = ["ctest", "--test-dir", str(build), "-V", "--timeout", "600"]  # a deadlock fails
        rc = run_scanned(cmd, env, None)
    else:
        build = (args.build_dir or ROOT / "build" / "sanitize-asan").resolve()
        configure(build, "address", tests=False)
        build_target(build, "_kernels", args.jobs)
        package_root = stage(build)
        built = time.monotonic()
        extra = {}
        tests = ASAN_TESTS
        if args.kind == "fuzz":
            extra["PAGECHECK_FUZZ_SECONDS"] = str(args.seconds)
            tests = FUZZ_TESTS
        log_dir = build / "reports"
        rc = run_scanned(pytest_cmd(tests, args.pytest_args), python_env(build, package_root, log_dir, extra),
                         log_dir)
    done = time.monotonic()
    _say(f"{args.kind}: {'PASS' if rc == 0 else 'FAIL'} (build {built - start:.0f} s, run {done - built:.0f} s)")
    return rc
