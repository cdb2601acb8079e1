"""The sanitized builds as CMake configures them (the real configure step into a scratch
directory, its compile commands read: about a second, nothing compiled).

| symptom                                                                   | caught by |
|---------------------------------------------------------------------------|-----------|
| the sanitizers build at the kernels' -O3 (ASan's decode.cpp: 103 s, not 25) | test_sanitized_builds_compile_at_o1 |
| TSan's driver fails to compile: a binding source among the kernel sources  | test_thread_driver_compiles_no_binding_source |
"""

import re
import subprocess
from pathlib import Path

import pytest

from fixtures.compile_commands import command_of, exported, last_level, sources_of

ROOT = Path(__file__).resolve().parents[1]


def _configured(tmp_path, monkeypatch, kind: str) -> Path:
    exported(monkeypatch)
    from sanitize import run

    monkeypatch.setattr(run, "_run", lambda cmd, **kwargs: subprocess.run(cmd, check=True, capture_output=True))
    run.configure(tmp_path, kind, tests=kind == "thread")
    return tmp_path


def _includes(source: Path, seen: set[Path]) -> set[str]:
    """Every #include <...> of source and of the project headers it includes (\"...\")."""
    seen.add(source)
    text = source.read_text()
    found = set(re.findall(r'^\s*#\s*include\s*<([^>]+)>', text, re.M))
    for local in re.findall(r'^\s*#\s*include\s*"([^"]+)"', text, re.M):
        header = source.parent / local
        if header.exists() and header not in seen:
            found |= _includes(header, seen)
    return found


@pytest.mark.parametrize("kind, target", [("address", "_kernels"), ("thread", "thread_driver")])
def test_sanitized_builds_compile_at_o1(tmp_path, monkeypatch, kind, target):
    """ASan's and TSan's builds (`python -m sanitize`) compile the kernels at -O1, as both
    sanitizers' manuals advise, with -g for the reports' lines: every access is still
    instrumented (the kernels' vectors are intrinsics), and the CI's sanitizer step took
    120 s instead of 224 (AMD Zen 5)."""
    command = command_of(_configured(tmp_path, monkeypatch, kind), "impl/csrc/decode.cpp", target)
    assert f"-fsanitize={kind}" in command and " -g " in command, command
    assert last_level(command) == "-O1", command


def test_thread_driver_compiles_no_binding_source(tmp_path, monkeypatch):
    """TSan's driver (impl/csrc/tests/thread_driver.cpp, `python -m sanitize tsan`) compiles
    the kernel sources without nanobind's headers: a Python-facing source among them
    (the serving call's key, impl/csrc/call_key.cpp, was) stops the CI's sanitizer step
    with "nanobind/nanobind.h: No such file or directory"."""
    sources = [s.resolve() for s in sources_of(_configured(tmp_path, monkeypatch, "thread"), "thread_driver")]
    assert ROOT / "impl/csrc/decode.cpp" in sources, sources  # the kernels are there
    binding = {s.relative_to(ROOT).as_posix() for s in sources
               if any(i.startswith("nanobind/") for i in _includes(s, set()))}
    assert binding == set(), f"compiled into the driver without nanobind's headers: {sorted(binding)}"
