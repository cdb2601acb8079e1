"""Worker-thread control and the GPU path."""

import os
import subprocess
import sys

import mlx.core as mx
import pytest

import impl
import pagecheck_kernels
from fixtures import paged_case

pytestmark = [pytest.mark.correctness, pytest.mark.builtin_only("the built-in kernel's worker threads and GPU path")]


def test_set_num_threads_round_trip():
    before = impl.num_threads()
    try:
        impl.set_num_threads(3)
        assert impl.num_threads() == 3
    finally:
        impl.set_num_threads(before)
    assert impl.num_threads() == before


@pytest.mark.parametrize("bad", [0, -1, True, 2.5])
def test_set_num_threads_rejects(bad):
    before = impl.num_threads()
    with pytest.raises((ValueError, TypeError)):
        impl.set_num_threads(bad)
    assert impl.num_threads() == before


@pytest.mark.parametrize("env,expected", [("3", 3), ("1", 1), ("zero", None), ("-4", None)])
def test_env_var_sets_the_initial_worker_count(env, expected):
    code = "import impl, os; print(impl.num_threads(), len(os.sched_getaffinity(0)))"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PAGECHECK_NUM_THREADS": env},
                         capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(__file__))).stdout.split()
    assert int(out[0]) == (expected if expected is not None else int(out[1]))


def test_gpu_stream_is_a_clear_error_never_a_dense_fallback():
    if not mx.is_available(mx.gpu):
        pytest.skip("this MLX build has no GPU backend, so eval_gpu cannot be reached here")
    case = paged_case(context_lens=[5], query_len=1)
    out = pagecheck_kernels.paged_attention(*case.args(), 0.25, True, 0, stream=mx.gpu)
    with pytest.raises(RuntimeError, match="no GPU kernel"):
        mx.eval(out)


RESIZE_STRESS = """
import impl
from fixtures import bits, paged_case
case = paged_case(context_lens=[40, 7, 30], query_len=1, q_heads=4, kv_heads=2, head_dim=16,
                  page_size=8, seed=51)
impl.set_num_threads(1)
expected = bits(case.run(impl.paged_attention))
for i in range(8000):
    impl.set_num_threads(2 + i % 3)
    assert bits(case.run(impl.paged_attention)) == expected, f"call {i}"
print("ok")
"""


def test_resizing_between_calls_never_hangs_or_changes_bits():
    """Workers made by a resize must wait for the next loop, not take the last one for
    new work: that miscounted busy workers and hung the caller in 2 of 3 runs of this
    loop. Run in a subprocess so a hang fails the test instead of stalling the suite."""
    out = subprocess.run([sys.executable, "-c", RESIZE_STRESS], capture_output=True, text=True, timeout=60,
                         cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
