"""Project-wide pytest set-up: hypothesis profiles, benchmarks untimed by default, and the
conformance plugin (conformance/plugin.py: --impl, the implementation under test, the
report)."""

from __future__ import annotations

import os
import tempfile

import pytest
from hypothesis import HealthCheck, settings

# --- Triton's interpreter where no NVIDIA GPU is visible (gpu/, peers/vllm_triton.py) ---
# triton decorates its own library (tl.cdiv, tl.max, ...) when first imported, as
# interpreter functions only if TRITON_INTERPRET=1 is set by then; a test module that
# imports torch or triton first would leave them compiled-mode functions that a kernel
# under the interpreter cannot call. So it is set here, before any test module runs,
# without importing torch: the NVIDIA driver's control device says whether a GPU can be.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

# --- hypothesis profiles (tests/test_properties.py, tests/test_*_machine.py) ---------
# "ci" (default): fixed examples (derandomize) and no example database, so runs are
# reproducible. "thorough": random and many more examples; each state machine runs
# max_examples x stateful_step_count >= 10^4 steps; tests/test_properties.py runs 4 x
# max_examples per operator property and max_examples per rejection kind.
# Select with `pytest --hypothesis-profile thorough` or HYPOTHESIS_PROFILE=thorough.
# Hypothesis's own files (the thorough example database, its cache of source constants)
# go to the temp dir, not to .hypothesis/ in the checkout.
os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", os.path.join(tempfile.gettempdir(), "pagecheck-hypothesis"))

settings.register_profile("ci", max_examples=30, stateful_step_count=25, deadline=None,
                          derandomize=True, database=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=250, stateful_step_count=50, deadline=None,
                          print_blob=True, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
# --- end of hypothesis profiles -----------------------------------------------------------

pytest_plugins = ["conformance.plugin"]  # --impl, the `attention` fixture, the report


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    # Plain `pytest` runs each benchmark once, untimed, as a smoke test of bench/;
    # `pytest --benchmark-only` (or --benchmark-enable) times them.
    if hasattr(config.option, "benchmark_disable") and not (
            config.option.benchmark_only or config.option.benchmark_enable):
        config.option.benchmark_disable = True
