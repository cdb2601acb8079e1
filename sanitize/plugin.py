"""pytest plugin of the sanitizer runs (`-p sanitize.plugin`, added by sanitize/run.py).

Makes sure a run is what it claims to be: the sanitizer runtime is mapped into the
process and `pagecheck_kernels` comes from the staged sanitized build, not from the
installed one (a wrong PYTHONPATH would otherwise give a clean, meaningless run). It also
turns MLX's buffer cache off, so a freed buffer goes back to malloc at once and a late
access to it is a use-after-free ASan can see, not a silent read of a recycled buffer.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def _mapped(path: str) -> bool:
    name = os.path.basename(path)
    with open("/proc/self/maps") as maps:
        return any(line.rstrip().endswith(name) for line in maps)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    expected = os.environ.get("PAGECHECK_SANITIZE_PACKAGE")
    runtime = os.environ.get("PAGECHECK_SANITIZE_RUNTIME")
    if not expected or not runtime:
        raise pytest.UsageError("sanitize.plugin is meant to run under `python -m sanitize`")
    if not _mapped(runtime):
        raise pytest.UsageError(f"{runtime} is not loaded: LD_PRELOAD did not take effect")
    import mlx.core as mx
    import pagecheck_kernels

    actual = Path(pagecheck_kernels.__file__).resolve().parent
    if actual != Path(expected).resolve():
        raise pytest.UsageError(f"pagecheck_kernels imported from {actual}, not the sanitized build {expected}")
    mx.set_cache_limit(0)


def pytest_report_header(config):
    import pagecheck_kernels

    return [f"sanitized pagecheck_kernels: {pagecheck_kernels.__file__}",
            f"runtime: {os.environ.get('PAGECHECK_SANITIZE_RUNTIME')}"]
