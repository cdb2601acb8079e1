"""The seeded-mutant catalog stays applicable (mutants/catalog.py): every snippet occurs
once in its file, ids are unique, and a mutant that needs AMX tiles or AVX-512 says so."""

import fnmatch
import os
import re
import subprocess
import tomllib
from pathlib import Path

import pytest

from fixtures.compile_commands import command_of, exported, last_level
from mutants.catalog import avx512_only, load, problems

ROOT = Path(__file__).resolve().parent.parent


def test_every_mutant_applies_to_the_tree():
    mutants = load()
    assert problems(mutants, ROOT) == []
    assert len({m.id for m in mutants}) == len(mutants)


# runs only where the CPU has AMX tiles
TILE_CODE = ("impl/csrc/amx.cpp", "impl/csrc/amx_walk.cpp", "impl/csrc/amx_chunk.h", "bench/amx_loops.cpp")
# mutants of shared files whose lines run only there: bench/paths.py's paged_packed is timed
# only where the tiles run (bench/grid.py skip_reason)
TILE_ONLY = ("bench-packed-path-reads-rows",)


def test_tile_path_mutants_are_marked():
    """A mutant of the tile path (or of the benchmark of its loops) is reachable only on
    AMX tiles, so it must carry needs = "amx" (else a machine without them reports it as
    a survivor)."""
    for m in load():
        assert (m.needs == "amx") == (m.file in TILE_CODE or m.id in TILE_ONLY), m.id


def test_avx512_mutants_are_marked():
    """A mutant of code only an AVX-512 build compiles (an `#if defined(__AVX512F__)`
    branch) changes nothing in an AVX2 build, so it must carry needs = "avx512" (or the
    tiles' or the pair dot product's, narrower still): else an AVX2-only machine (an AMD
    EPYC Zen 3, 2026-12-07) reports it as a survivor. And a mutant that says so is such code."""
    for m in load():
        if not m.file.startswith("impl/csrc/"):
            assert m.needs != "avx512", m.id
            continue
        only = avx512_only((ROOT / m.file).read_text(), m.original)
        assert (m.needs in ("avx512", "amx", "pair_dots")) if only else (m.needs != "avx512"), m.id


def test_avx512_only_reads_the_branches():
    text = """a0
#if defined(__AVX512F__)
a1
#if defined(__FMA__)
a2
#else
a3
#endif
a4
#else
a5
#endif
#if defined(__AVX512BW__) && defined(__AVX512BF16__)
a6
#elif defined(__AVX512F__)
a7
#endif
#if defined(__AVX512F__) || defined(__FMA__)
a8
#endif
#ifndef __AVX512F__
a9
#endif
"""
    only = {f"a{i}" for i in range(10) if avx512_only(text, f"a{i}")}
    assert only == {"a1", "a2", "a3", "a4", "a6", "a7"}
    assert not avx512_only(text, "absent")


def test_avx512_tells_the_build():
    """pagecheck_kernels.AVX512: the build compiled its AVX-512 branches, as -march=native
    does where this CPU has AVX-512F; the runner reports mutants that need it "not
    applicable" where it is false."""
    import pagecheck_kernels

    from mutants.runner import lacking
    from peers import cpu_flags

    assert pagecheck_kernels.AVX512 is ("avx512f" in cpu_flags())
    assert lacking()["avx512"] is (not pagecheck_kernels.AVX512)


def test_unknown_needs_is_a_catalog_error(tmp_path):
    (tmp_path / "x.toml").write_text('[[mutant]]\nid = "a"\nfile = "f"\noriginal = "x"\nreplacement = "y"\n'
                                     'breaks = "b"\nkillers = ["t"]\nneeds = "gpu"\n')
    with pytest.raises(ValueError, match="known: amx, triton"):
        load(tmp_path)


def test_triton_mutants_name_their_implementation():
    """A mutant of gpu/ breaks the Triton kernels, which the built-in's suite never calls:
    it must be judged on them (`impl`) and be skippable where triton is absent (`needs`)."""
    gpu = [m for m in load() if m.file.startswith("gpu/kernels")]
    assert len(gpu) >= 6
    assert all(m.needs == "triton" and m.impl == "gpu.paged:paged_attention" for m in gpu), gpu


def test_mutmut_smoke_fails_on_timeouts_and_survivors():
    """CI's mutmut smoke run (.ci/run) passes only when every named mutant is killed: a
    timeout counts as detected in the score, but for mutants that fail in seconds it means
    the run itself is broken (every mutant timed out when the fork server had started
    MLX's threads)."""
    from mutants.mutmut_run import report, smoke_passes

    def mutant(status):
        return {"name": f"m-{status}", "file": "impl/allocator.py", "status": status, "line": 1,
                "function": "f", "original": "a", "mutated": "b"}

    assert smoke_passes(report([mutant("killed"), mutant("killed")], []))
    assert not smoke_passes(report([mutant("killed"), mutant("timeout")], []))
    assert report([mutant("killed"), mutant("timeout")], [])["score"] == 1.0  # the score alone would pass
    assert not smoke_passes(report([mutant("killed"), mutant("survived")], []))
    assert not smoke_passes(report([], []))


def test_mutmut_leaves_out_every_test_of_the_mutants_package():
    """mutmut's scratch copy has no `mutants` package (its work dir takes the name), so a
    test module importing it must be ignored there, or mutmut's stats run fails to collect
    ("failed to collect stats. runner returned 1") and the whole mutation run with it."""
    args = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]["pytest_add_cli_args"]
    ignored = [a.split("=", 1)[1] for a in args if a.startswith(("--ignore=", "--ignore-glob="))]
    importing = [p.relative_to(ROOT).as_posix() for p in sorted((ROOT / "tests").glob("*.py"))
                 if re.search(r"^\s*(from|import) mutants\b", p.read_text(), re.M)]
    assert importing, "no test imports the mutants package: the check reads nothing"
    assert [f for f in importing if not any(fnmatch.fnmatch(f, g) for g in ignored)] == []


MUTMUT_CONFIG = """[tool.mutmut]
only_mutate = ["impl/allocator.py"]
pytest_add_cli_args = ["-p", "no:randomly", "--ignore-glob=tests/test_mutant_*.py"]
pytest_add_cli_args_test_selection = ["tests", "-m", "correctness and not slow"]
"""


def test_mutmut_tests_narrow_only_the_selection_mutmut_runs(tmp_path):
    """`--tests` (CI's smoke run) narrows the paths mutmut's runs take and keeps the
    configured marker expression, and nothing else in the config."""
    from mutants.mutmut_run import narrow_tests

    (tmp_path / "pyproject.toml").write_text(MUTMUT_CONFIG)
    narrow_tests(tmp_path, ["tests/test_cache.py", "tests/test_pool.py"])
    config = tomllib.loads((tmp_path / "pyproject.toml").read_text())["tool"]["mutmut"]
    assert config == {**tomllib.loads(MUTMUT_CONFIG)["tool"]["mutmut"],
                      "pytest_add_cli_args_test_selection": ["tests/test_cache.py", "tests/test_pool.py",
                                                             "-m", "correctness and not slow"]}


def test_mutmut_tests_that_are_no_path_are_refused_before_any_work(monkeypatch, capsys):
    """Mutant names after `--tests` would be taken as test paths (its nargs takes every
    word) and fail mutmut's stats run minutes later: refused at once, naming them, with no
    scratch copy made; real paths pass the check."""
    import tempfile

    from mutants import mutmut_run

    def no_copy(*args, **kwargs):
        raise AssertionError("a scratch copy was made")

    monkeypatch.setattr(tempfile, "mkdtemp", no_copy)
    name = "impl.pool.xǁPagePoolǁ__init____mutmut_1"
    with pytest.raises(SystemExit) as e:
        mutmut_run.main(["--tests", "tests/test_pool.py", name, "tests"])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(  # after argparse's program name
        f": error: --tests: no such test file or directory: {name} "
        "(mutant names go before --tests, which takes every word after it)")
    with pytest.raises(AssertionError, match="a scratch copy was made"):  # past the check
        mutmut_run.main([name, "--tests", "tests/test_pool.py", "tests"])


@pytest.mark.parametrize("broken", ["fails", "cannot collect"])
def test_mutmut_copy_check_runs_the_whole_configured_selection(tmp_path, broken):
    """Before a narrowed run, the whole configured selection runs once in the copy: a test
    there that fails, or cannot be collected (the copy has no `mutants` package), fails the
    check though the narrowed tests pass; tests outside the marker expression are not run."""
    from mutants.mutmut_run import check_copy

    (tmp_path / "pyproject.toml").write_text(MUTMUT_CONFIG + '\n[tool.pytest.ini_options]\nmarkers = ["correctness", "slow"]\n')
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_a.py").write_text("import pytest\n\n@pytest.mark.correctness\ndef test_ok():\n    pass\n\n"
                                     "@pytest.mark.slow\n@pytest.mark.correctness\ndef test_slow_one():\n"
                                     "    assert False\n")
    assert check_copy(tmp_path, 2) is None
    bad = ("import pytest\n\n@pytest.mark.correctness\ndef test_bad():\n    assert 1 == 2\n" if broken == "fails"
           else "import no_such_package_here\n")
    (tests / "test_b.py").write_text(bad)
    failed = check_copy(tmp_path, 2)
    assert failed is not None and ("test_bad" if broken == "fails" else "no_such_package_here") in failed


@pytest.mark.parametrize("cache", ["/opt/bin/ccache", None])
def test_mutant_builds_compile_through_one_cache_per_run(tmp_path, monkeypatch, cache):
    """With ccache, every worker of a run configures it as the compiler launcher and
    compiles into the run's one cache, its paths relative to the run's scratch base (so a
    restored file's dependents, and another worker's objects, are hits); without ccache
    the build is plain. Later builds only build (the configure step runs once)."""
    from mutants import runner

    monkeypatch.setattr(runner, "compiler_cache", lambda: cache)
    calls = []

    def run(cmd, **kwargs):
        calls.append((cmd, kwargs["env"]))
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(runner.subprocess, "run", run)
    workers = [runner.Worker(i, tmp_path, []) for i in range(2)]
    for worker in workers:
        (worker.dir / "impl/csrc").mkdir(parents=True)
        (worker.dir / "impl/csrc/pagecheck_kernels_init.py").write_text("")
        assert worker._build() == (True, "") and worker._build() == (True, "")
    configures = [cmd for cmd, _ in calls if "-S" in cmd]
    assert len(configures) == 2 and len(calls) == 6
    launchers = [[a for a in cmd if "COMPILER_LAUNCHER" in a] for cmd in configures]
    assert launchers == ([[f"-DCMAKE_CXX_COMPILER_LAUNCHER={cache}"]] * 2 if cache else [[], []])
    for _, env in calls:
        assert (env["CCACHE_DIR"], env["CCACHE_BASEDIR"]) == (str(tmp_path / "ccache"), str(tmp_path))
        assert env["CCACHE_NOHASHDIR"] == "1"
        # the builds precompile the standard headers: ccache caches no such compile without these
        assert {"pch_defines", "time_macros"} <= set(env["CCACHE_SLOPPINESS"].split(","))


def test_mutant_test_runs_are_not_taken_for_a_ci_run(tmp_path, monkeypatch):
    """Where CI (or BUILD_NUMBER) is set, pytest explains a failed `==` of sequences with a
    full diff, quadratic over a kernel call's output bytes: a mutant's failing check took
    over 300 s (the runner's time-out) instead of a second. The runner's and the mutmut
    run's test runs get the environment without them, and nothing else changed."""
    from mutants import mutmut_run, runner

    monkeypatch.setenv("CI", "true")
    monkeypatch.setenv("BUILD_NUMBER", "7")
    worker = runner.Worker(0, tmp_path, [])
    worker.dir.mkdir()
    (worker.dir / "test_env.py").write_text("import os\n\ndef test_not_ci():\n"
                                            "    assert os.environ.get('CI') is None, os.environ['CI']\n"
                                            "    assert os.environ.get('BUILD_NUMBER') is None\n")
    env = worker._env(None)
    assert worker._pytest(["test_env.py"], env) is None  # a real run in the worker's tree
    rest = {k: v for k, v in os.environ.items() if k not in ("CI", "BUILD_NUMBER")}
    runs = {k: v for k, v in rest.items() if k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX")}
    assert env == {**runs, "PAGECHECK_NUM_THREADS": "1", "PYTHONPATH": str(worker.dir)}
    without_path = {k: v for k, v in rest.items() if k != "PYTHONPATH"}
    assert mutmut_run._env() == {**without_path, "PAGECHECK_NUM_THREADS": "1", "HYPOTHESIS_PROFILE": "ci"}


def test_mutant_runs_cache_bytecode_yet_never_import_a_stale_one(tmp_path, monkeypatch):
    """The worker's test runs cache their bytecode (a run no longer recompiles the conftest's
    plugins: ~0.6 s a mutant) beside the scratch tree's sources, even where the caller sets
    PYTHONDONTWRITEBYTECODE or PYTHONPYCACHEPREFIX, and never import a stale .pyc: Python
    takes one for current when the source's mtime in whole seconds and its size match, and
    a mutant of the same size applied to a module run in the same second, or restored in
    the second it ran, would be imported in its place. Here every write of the worker lands
    on one mtime, as in that second."""
    from mutants import runner
    from mutants.catalog import Mutant

    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.setenv("PYTHONPYCACHEPREFIX", str(tmp_path / "elsewhere"))
    write = Path.write_text

    def in_one_second(self, text, *args, **kwargs):
        written = write(self, text, *args, **kwargs)
        os.utime(self, (1_700_000_000, 1_700_000_000))
        return written

    monkeypatch.setattr(Path, "write_text", in_one_second)
    worker = runner.Worker(0, tmp_path, [])
    worker.dir.mkdir()
    (worker.dir / "level.py").write_text("LEVEL = 1\n")
    (worker.dir / "test_level.py").write_text("import level\n\ndef test_level():\n    assert level.LEVEL == 1\n")
    mutant = Mutant(id="level-two", file="level.py", original="LEVEL = 1", replacement="LEVEL = 2",
                    breaks="the level is two", killers=("test_level.py",), source="test")
    env = worker._env(None)
    assert worker._pytest(["test_level.py"], env) is None  # the pristine module, cached
    assert worker.run(mutant) == {"id": "level-two", "status": "killed", "killed_by": "test_level.py::test_level",
                                  "seconds": pytest.approx(0, abs=60), "file": "level.py",
                                  "breaks": "the level is two"}
    assert worker._pytest(["test_level.py"], env) is None  # restored: the pristine module again
    cached = sorted(p.relative_to(worker.dir) for p in worker.dir.rglob("*.pyc"))
    assert [(p.parent, p.name.split(".")[0]) for p in cached] == [(Path("__pycache__"), "level"),
                                                                   (Path("__pycache__"), "test_level")]


@pytest.mark.parametrize("pristine_bits", ["pinned", "differ"])
def test_mutant_build_is_checked_for_the_pinned_bits_before_any_kill(tmp_path, monkeypatch, pristine_bits):
    """A worker's first C++ build is of the unmutated tree, at the mutant builds'
    optimization level, and must give the golden bits: were they another build's (a level
    that changes the arithmetic), every C++ kill would be the build's, not the mutant's."""
    from mutants import runner
    from mutants.catalog import Mutant

    worker = runner.Worker(0, tmp_path, [])
    target = worker.dir / "impl/csrc/kernel.h"
    target.parent.mkdir(parents=True)
    target.write_text("int x = 1;\n")
    seen = []

    def build():
        seen.append(("build", target.read_text()))
        worker.configured = True
        return True, ""

    def pytest_run(args, env):
        seen.append(("pytest", args[0]))
        return "tests/test_golden_bits.py::pinned" if args == runner.BITS_CHECK and pristine_bits == "differ" \
            else "tests/test_x.py::killer" if args[0] == "tests/test_x.py::killer" else None

    monkeypatch.setattr(worker, "_build", build)
    monkeypatch.setattr(worker, "_pytest", pytest_run)
    mutant = Mutant("m", "impl/csrc/kernel.h", "x = 1", "x = 2", "b", ("tests/test_x.py::killer",), "t.toml")
    if pristine_bits == "differ":
        with pytest.raises(RuntimeError, match="golden_bits"):
            worker.run(mutant)
        assert seen == [("build", "int x = 1;\n"), ("pytest", "tests/test_golden_bits.py")]
    else:
        assert worker.run(mutant)["status"] == "killed"
        worker.run(mutant)  # the check runs once per worker
        assert seen == [("build", "int x = 1;\n"), ("pytest", "tests/test_golden_bits.py"),
                        ("build", "int x = 2;\n"), ("pytest", "tests/test_x.py::killer"),
                        ("build", "int x = 2;\n"), ("pytest", "tests/test_x.py::killer")]
    assert target.read_text() == "int x = 1;\n"


def test_mutant_builds_precompile_the_standard_headers(tmp_path, monkeypatch):
    """A worker of the mutant runner configures its build at -O0 with the standard and
    intrinsics headers precompiled (the real configure step, its compile commands read):
    every kernel file includes the precompiled header, which holds <immintrin.h> and the
    containers (6.0 -> 4.2 s to rebuild blocks.h's dependents on one core)."""
    exported(monkeypatch)
    from mutants import runner

    sources = ["CMakeLists.txt", *(f"impl/csrc/{p.name}" for p in (runner.ROOT / "impl/csrc").iterdir() if p.is_file())]
    worker = runner.Worker(0, tmp_path, sources)
    subprocess.run(worker.configure_command(), check=True, capture_output=True)
    for source in ("decode.cpp", "prefill.cpp", "paged_attention.cpp", "bindings.cpp"):
        command = command_of(worker.build, f"impl/csrc/{source}")
        assert last_level(command) == runner.OPT_LEVEL == "-O0", command
        header = re.search(r"-include (\S+cmake_pch\.hxx)(?!\S)", command)
        assert header, command
    included = Path(header.group(1)).read_text()
    for name in ("<immintrin.h>", "<vector>", "<algorithm>", "<cmath>"):
        assert f"#include {name}" in included, included
