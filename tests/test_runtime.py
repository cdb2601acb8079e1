"""Worker-thread control and the GPU path."""

import os
import subprocess
import sys

import mlx.core as mx
import pytest

import impl
import pagecheck_kernels
from fixtures import bits, paged_case

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
    out, _ = pagecheck_kernels.paged_attention(*case.args(), 0.25, True, 0, stream=mx.gpu)
    with pytest.raises(RuntimeError, match="no GPU kernel"):
        mx.eval(out)


def _names_the_cpu(stream) -> bool:
    """Whether a `stream=` argument pins the CPU: mx.cpu or a stream of it (None, the
    default stream, would follow mx.default_device())."""
    device = stream.device if isinstance(stream, mx.Stream) else stream
    return device is not None and device == mx.cpu


@pytest.mark.parametrize("path", ["paged_attention", "paged_attention_with_metadata"])
def test_builtin_schedules_the_kernel_on_the_cpu_stream(path, monkeypatch):
    """The primitive has no GPU kernel; where MLX's default device is the GPU (macOS),
    a primitive on the default stream goes to eval_gpu and raises. Both entry points
    must pin the CPU stream themselves. This MLX build cannot make the GPU the default
    (mlx[cpu]: no GPU backend), so a spy on the compiled entry point records the stream
    each call was given: it must name the CPU, not leave it to the default."""
    case = paged_case(context_lens=[9, 0, 4], query_len=2, seed=61)
    want = bits(case.run(impl.paged_attention))
    seen = []
    real = pagecheck_kernels.paged_attention

    def spy(*args, **kwargs):
        seen.append(kwargs.get("stream"))
        return real(*args, **kwargs)

    monkeypatch.setattr(pagecheck_kernels, "paged_attention", spy)
    if path == "paged_attention":
        out = case.run(impl.paged_attention)
    else:
        meta = impl.PagedMetadata.build(case.block_table, case.context_lens, page_size=case.page_size,
                                        num_pages=case.key_pages.shape[0], query_len=2)
        out = impl.paged_attention_with_metadata(case.query, case.key_pages, case.value_pages, meta)
    assert len(seen) == 1, f"{path} called the compiled entry point {len(seen)} times"
    assert _names_the_cpu(seen[0]), f"{path} passed stream={seen[0]!r}: the default stream, not the CPU's"
    assert bits(out) == want


@pytest.mark.parametrize("quantized,names", [
    ({}, {"write_slots", "copy_pages"}),
    ({"kv_dtype": "int8", "scales": "token"}, {"write_slots", "copy_pages", "quantize_slots", "row_scales",
                                                "write_scales"})], ids=["float", "int8-token"])
def test_pool_updates_are_scheduled_on_the_cpu_stream(monkeypatch, quantized, names):
    """The pool's in-place writes and page copies (and a quantized pool's encoding, row
    scales and token-scale writes) are primitives of their own (no GPU kernel either):
    each must pin the CPU stream, as attention does."""
    from fixtures.serving import pool_rows

    pool = impl.pool.PagePool(num_layers=1, kv_heads=2, head_dim=8, page_size=4, num_pages=6, poison_freed=True,
                              **quantized)
    seen = []
    for name in names:
        real = getattr(pagecheck_kernels, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            seen.append((_name, kwargs.get("stream")))
            return _real(*args, **kwargs)

        monkeypatch.setattr(pagecheck_kernels, name, spy)
    pool.allocate(3)
    pool.write(0, [0, 5], pool_rows(pool, 2), pool_rows(pool, 2, seed=1))
    pool.copy_pages([0], [2])
    pool.free([1])  # poison_freed: NaN written through write_slots
    mx.eval(pool.keys(0), pool.values(0), list(pool.kv_options(0).values())[1:])
    assert {name for name, _ in seen} == names, seen
    assert all(_names_the_cpu(stream) for _, stream in seen), f"a pool update left on the default stream: {seen}"


def test_builtin_runs_on_the_cpu_when_the_default_device_is_the_gpu():
    """End to end: with the GPU as the default device both entry points evaluate (no
    eval_gpu error) and give the CPU default's bits. Skipped in the body, so that for
    another implementation the module's built-in-only skip comes first."""
    if not mx.is_available(mx.gpu):
        pytest.skip("this MLX build has no GPU backend (mlx[cpu], Linux): the default device cannot be the GPU "
                    "here; this runs where it can (MLX with Metal, macOS on Apple silicon)")
    case = paged_case(context_lens=[9, 0, 4], query_len=2, seed=61)
    meta = impl.PagedMetadata.build(case.block_table, case.context_lens, page_size=case.page_size,
                                    num_pages=case.key_pages.shape[0], query_len=2)

    def both():
        return (bits(case.run(impl.paged_attention)),
                bits(impl.paged_attention_with_metadata(case.query, case.key_pages, case.value_pages, meta)))

    before = mx.default_device()
    mx.set_default_device(mx.cpu)
    try:
        want = both()
        mx.set_default_device(mx.gpu)
        got = both()
    finally:
        mx.set_default_device(before)
    assert got == want


# How long a script of a few calls may take before it counts as hung: each takes 0.2 s at
# -O3 and 1.7 s in the mutant runner's -O0 builds, where a thread-pool mutant that hangs it
# is killed only by this time-out (30 s had each such mutant take 32 s of the catalog).
HANG = 10


def _prints_ok(script: str, timeout: float) -> None:
    """Runs `script` in a fresh interpreter at the repository root; it must print "ok"
    within `timeout` s (a hang raises TimeoutExpired: the test fails, the suite goes on)."""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout,
                         cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


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
    _prints_ok(RESIZE_STRESS, timeout=60)


HELD_WORKERS = """
import impl, pagecheck_kernels
from fixtures import bits, paged_case
cases = [paged_case(context_lens=[600, 0, 33], query_len=1, q_heads=4, kv_heads=2, head_dim=16, page_size=8, seed=52),
         paged_case(context_lens=[300, 70], query_len=70, q_heads=4, kv_heads=2, head_dim=16, page_size=16, seed=53)]
def now(case):
    meta = impl.PagedMetadata.build(case.block_table, case.context_lens, page_size=case.page_size,
                                    num_pages=case.key_pages.shape[0], query_len=case.query.shape[2])
    return bits(impl.paged_attention_now(case.query, case.key_pages, case.value_pages, meta))
def both(case):
    return bits(case.run(impl.paged_attention)), now(case)
impl.set_num_threads(1)
expected = [both(case) for case in cases]
impl.set_num_threads(3)
pagecheck_kernels.hold_workers(True)
before = pagecheck_kernels.worker_items()
for i in range(200):
    for case, want in zip(cases, expected):
        assert both(case) == want, f"held, call {i}"
assert pagecheck_kernels.worker_items() == before, "a held worker ran items"
pagecheck_kernels.hold_workers(False)
for case, want in zip(cases, expected):
    assert both(case) == want, "released"
print("ok")
"""


def test_a_call_never_waits_for_a_worker_that_never_runs():
    """The caller runs every item no worker claimed and waits only for claimed ones: with
    the workers held (as if the OS never gave them a core), decodes with a merge loop and a
    prefill, lazy and eager, finish in the calling thread with the 1-worker bits. The
    pool used to wait for every worker to check in to each loop, so a loaded machine's
    small calls waited for a time slice, and held workers hung it (hence the subprocess)."""
    _prints_ok(HELD_WORKERS, timeout=HANG)


LONG_ITEMS = """
import impl
from fixtures import bits, paged_case
case = paged_case(context_lens=[640, 512], query_len=512, q_heads=8, kv_heads=2, head_dim=64, page_size=16, seed=54)
impl.set_num_threads(1)
expected = bits(case.run(impl.paged_attention))
impl.set_num_threads(3)
for i in range(20):
    assert bits(case.run(impl.paged_attention)) == expected, f"call {i}"
print("ok")
"""


def test_a_call_waits_for_the_long_items_workers_hold():
    """Prefill items take longer than the caller's spin, so a caller whose own items are
    done sleeps until a worker's last one is: the worker that finishes it must wake it
    (a lost wake-up hangs the call, hence the subprocess), and the call returns the
    1-worker bits."""
    _prints_ok(LONG_ITEMS, timeout=HANG)


HOLD = """
import time
import impl, pagecheck_kernels
from fixtures import paged_case
case = paged_case(context_lens=[1024], query_len=1, q_heads=16, kv_heads=4, head_dim=128, page_size=16, seed=55)
meta = impl.PagedMetadata.build(case.block_table, case.context_lens, page_size=case.page_size,
                                num_pages=case.key_pages.shape[0], query_len=1)
def call():
    impl.paged_attention_now(case.query, case.key_pages, case.value_pages, meta)
impl.set_num_threads(2)
call()
items = pagecheck_kernels.worker_items()
# 100 calls at least, and on until the worker has run items: on a loaded machine (the
# suite's other process on the second core) it may get no core for 100 calls (11 ms), and
# a worker that never ran cannot have yielded early, so the count below would prove nothing
deadline = time.monotonic() + 20
trial = 0
while trial < 50 or (pagecheck_kernels.worker_items() == items and time.monotonic() < deadline):
    call()
    call()  # microseconds after the last loop: its worker still holds its core
    trial += 1
assert pagecheck_kernels.worker_items() > items, "the worker never ran an item in 20 s of calls"
early = pagecheck_kernels.worker_early_yields()
assert early == 0, f"a worker yielded its core before its hold had passed, in {early} idle spells"
before = pagecheck_kernels.worker_yields()
# Its hold ends within milliseconds, but on a loaded machine the worker may then wait a time
# slice or more for a core to yield on (20 ms was too short once, beside the suite's other
# process on an AVX2 Zen 3): polled for 2 s. A hold that never ends never yields at all.
deadline = time.monotonic() + 2
while pagecheck_kernels.worker_yields() == before and time.monotonic() < deadline:
    time.sleep(0.01)
assert pagecheck_kernels.worker_yields() > before, "an idle worker never stopped holding its core"
print("ok")
"""


def test_a_worker_keeps_its_core_between_back_to_back_calls():
    """After a loop a worker polls with pauses for a short hold (thread_pool.cpp kHold)
    before it yields its core: a worker that yielded at once lost its core to any other
    runnable thread for a time slice, and the caller ran every item alone (B 1 S 128
    decodes beside a nice-19 busy loop: 36 us median against 21). Over 100 calls
    microseconds apart no worker yields before its hold has passed (a count of the idle
    spells whose first yield came early, exact whatever the load: counting the yields
    between two calls, as this test first did, let the broken hold pass on a loaded
    machine, where the worker is not on a core in that gap either); an idle one starts
    yielding soon after (the hold ends). In a subprocess: a fresh pool, and its counters
    are the script's own. The calls go on until the worker has run an item (20 s at most):
    the other test process can keep it off a core for 100 calls."""
    _prints_ok(HOLD, timeout=60)
