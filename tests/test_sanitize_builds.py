"""The sanitized builds as CMake configures them (the real configure step into a scratch
directory, its compile commands read: about a second, nothing compiled).

| symptom                                                                   | caught by |
|---------------------------------------------------------------------------|-----------|
| the sanitizers build at the kernels' -O3 (ASan's decode.cpp: 103 s, not 25) | test_sanitized_builds_compile_at_o1 |
"""

import subprocess

import pytest

from fixtures.compile_commands import command_of, exported, last_level


@pytest.mark.parametrize("kind, target", [("address", "_kernels"), ("thread", "thread_driver")])
def test_sanitized_builds_compile_at_o1(tmp_path, monkeypatch, kind, target):
    """ASan's and TSan's builds (`python -m sanitize`) compile the kernels at -O1, as both
    sanitizers' manuals advise, with -g for the reports' lines: every access is still
    instrumented (the kernels' vectors are intrinsics), and the CI's sanitizer step took
    120 s instead of 224 (AMD Zen 5)."""
    exported(monkeypatch)
    from sanitize import run

    monkeypatch.setattr(run, "_run", lambda cmd, **kwargs: subprocess.run(cmd, check=True, capture_output=True))
    run.configure(tmp_path, kind, tests=kind == "thread")
    command = command_of(tmp_path, "impl/csrc/decode.cpp", target)
    assert f"-fsanitize={kind}" in command and " -g " in command, command
    assert last_level(command) == "-O1", command
