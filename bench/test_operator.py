"""Operator latency, every path side by side on identical inputs (`pytest --benchmark-only`).

The grid, the paths and the skips are bench/grid.py's and bench/paths.py's, shared with
`python -m bench.report`. Plain `pytest` runs the small smoke grid, each call once and
untimed, and checks that every path computes the same attention; `--benchmark-only`
runs the full grid (`PAGECHECK_BENCH_GRID=quick` for the small one) with adaptive
rounds (bench/timing.py). Compare medians within one run only: the machine is shared.
Each benchmark's extra_info carries its bytes (decode) or FLOPs (prefill), so
`--benchmark-json` holds everything needed for bandwidth and GFLOP/s.
"""

import warnings

import mlx.core as mx
import numpy as np
import pytest

from bench import grid, paths, timing
from fixtures.quantized import code_values


def _level(config) -> str:
    return grid.pytest_level(config)


def pytest_generate_tests(metafunc):
    specs = grid.attention_specs(_level(metafunc.config))
    if "path" in metafunc.fixturenames:
        cases = [(s, p) for s in specs for p in grid.PATHS]
        metafunc.parametrize(("spec", "path"), cases, ids=[f"{s.id}-{p}" for s, p in cases])
    elif "spec" in metafunc.fixturenames:
        metafunc.parametrize("spec", specs, ids=[s.id for s in specs])


@pytest.fixture(scope="module")
def pools(request):
    made = paths.Pools(grid.attention_specs(_level(request.config)))
    yield made
    del made


def _time(request, benchmark, fn):
    """`fn` once where benchmarks are off (plain pytest), else for the rounds its level asks."""
    if benchmark.disabled:
        benchmark(fn)
        return
    rounds = timing.rounds_for(timing.timed(fn), _level(request.config))
    benchmark.pedantic(fn, rounds=rounds, iterations=1, warmup_rounds=0)


def test_operator(request, benchmark, pools, spec, path):
    reason = grid.skip_reason(spec, path)
    if reason:
        pytest.skip(reason)
    run = paths.make(path, pools.case_for(spec, path), spec.rows)
    benchmark.group = f"{spec.id}"
    benchmark.extra_info.update(spec.describe(), path=path, bytes=spec.io_bytes(path), flops=spec.flops())
    _time(request, benchmark, run)


def test_vllm_cpu_metadata(request, benchmark, pools, spec):
    """vLLM's per-step scheduler metadata alone (`get_scheduler_metadata`), timed apart
    from its kernel call (test_operator's vllm_cpu rows), as issue 22 asks."""
    reason = grid.skip_reason(spec, "vllm_cpu")
    if reason:
        pytest.skip(reason)
    meta = paths.make("vllm_cpu", pools.case(spec), spec.rows).metadata
    benchmark.group = f"{spec.id}"
    benchmark.extra_info.update(spec.describe(), path="vllm_cpu metadata")
    _time(request, benchmark, meta)


def test_vllm_cpu_order(request, benchmark, pools, spec):
    """With --benchmark-only: vllm_cpu / paged timed interleaved and in blocks
    (timing.order_check, quick budget); both ratios and whether they agree go into
    extra_info (--benchmark-json) of a one-round benchmark of the pair (paged, then
    vllm_cpu). A disagreement beyond timing.ORDER_TOLERANCE is a warning, not a failure:
    it says which order to trust under load, not that a kernel is wrong."""
    if benchmark.disabled:
        pytest.skip("timed with --benchmark-only")
    reason = grid.skip_reason(spec, "paged") or grid.skip_reason(spec, "vllm_cpu")
    if reason:
        pytest.skip(reason)
    case = pools.case(spec)
    paged, vllm = paths.make("paged", case, spec.rows), paths.make("vllm_cpu", case, spec.rows)
    rounds = min(timing.rounds_for(timing.timed(paged), "quick"), timing.rounds_for(timing.timed(vllm), "quick"))
    order = timing.order_check(paged, vllm, rounds)
    benchmark.group = f"{spec.id}"
    benchmark.extra_info.update(spec.describe(), path="paged, then vllm_cpu (order check)", **order)
    benchmark.pedantic(lambda: (paged(), vllm()), rounds=1, iterations=1, warmup_rounds=0)
    if not order["agree"]:
        warnings.warn(f"{spec.id}: vllm_cpu / paged interleaved {order['interleaved_ratio']:.2f}x vs blocked "
                      f"{order['blocked_ratio']:.2f}x (beyond {timing.ORDER_TOLERANCE:.0%})")


def test_paths_agree(request, pools, spec):
    """Every timed path computes the same attention (smoke grid only: the check is for
    the benchmark's own set-up, e.g. torch's causal mask alignment)."""
    if _level(request.config) != "smoke":
        pytest.skip("checked by the smoke grid (plain pytest)")
    case = pools.case(spec)
    want = paths.result(paths.make("paged", case, spec.rows))
    tol = 2e-2 if spec.dtype == "bfloat16" else 1e-4
    for path in grid.PATHS:
        if grid.skip_reason(spec, path) is None and path not in grid.KV_PATHS:
            got = paths.result(paths.make(path, pools.case_for(spec, path), spec.rows))
            np.testing.assert_allclose(got, want, atol=tol, rtol=tol, err_msg=f"{path} vs paged at {spec.id}")
            if path in ("paged_now", "paged_packed"):  # the same kernel (and pages, in another order)
                np.testing.assert_array_equal(got, want, err_msg=f"{path} vs paged at {spec.id}")


def test_now_paths_call_the_eager_entry(request, pools, spec, monkeypatch):
    """paged_now and paged_packed run impl.paged_attention_now (computed in the calling
    thread), never the lazy entry; paged runs the lazy one (smoke grid only)."""
    import impl

    if _level(request.config) != "smoke":
        pytest.skip("checked by the smoke grid (plain pytest)")
    calls = []
    for name in ("paged_attention_now", "paged_attention_with_metadata"):
        real = getattr(impl, name)
        monkeypatch.setattr(impl, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    for path, entry in (("paged", "paged_attention_with_metadata"), ("paged_now", "paged_attention_now"),
                        ("paged_packed", "paged_attention_now")):
        if grid.skip_reason(spec, path) is None:
            calls.clear()
            paths.make(path, pools.case_for(spec, path), spec.rows)()
            assert calls and set(calls) == {entry}, (path, calls)


def test_quantized_paths_read_their_codes(request, pools, spec):
    """A quantized path (grid.KV_PATHS) computes attention over its pool's dequantized
    values: `paged` on the float pool fixtures.quantized decodes from its codes agrees
    (smoke grid only, like test_paths_agree)."""
    if _level(request.config) != "smoke":
        pytest.skip("checked by the smoke grid (plain pytest)")
    tol = 2e-2 if spec.dtype == "bfloat16" else 1e-4
    for path in grid.KV_PATHS:
        case = pools.case_for(spec, path)
        want = paths.as_numpy(paths.make("paged", dequantized(case))())
        got = paths.as_numpy(paths.make(path, case)())
        assert np.isfinite(got).all(), f"{path} at {spec.id}: the random codes must all be finite"
        np.testing.assert_allclose(got, want, atol=tol, rtol=tol, err_msg=f"{path} vs paged at {spec.id}")


def dequantized(case):
    """The case with float32 pages holding its codes' values times their scales."""
    def values(codes, scale):
        x = code_values(case.kv_dtype)[np.array(codes).view(np.uint8)]
        s = np.array(scale, dtype=np.float64)
        s = s[..., None] if s.ndim == 3 else s[None, :, None, None] if s.ndim == 1 else s
        return mx.array((x * s).astype(np.float32)).astype(case.dtype)
    return case.with_(key_pages=values(case.key_pages, case.k_scale),
                      value_pages=values(case.value_pages, case.v_scale), kv_dtype=None, k_scale=None, v_scale=None)


def test_packed_pages_are_timed_only_where_the_tiles_run(monkeypatch):
    """paged_packed is a serving path only on a machine with AMX tiles: without them the
    FMA path reads the packed order ~10x slower than rows, and the vLLM goals, which
    judge paged_packed first where it was timed, would report a layout no one would pick."""
    import impl

    spec = grid.Spec("decode", 1, 1024, 128, "bfloat16", 1)
    monkeypatch.setattr(impl, "amx_enabled", lambda: True)
    assert grid.skip_reason(spec, "paged_packed") is None
    monkeypatch.setattr(impl, "amx_enabled", lambda: False)
    assert "runs no tiles" in grid.skip_reason(spec, "paged_packed")
    assert grid.skip_reason(spec, "paged_now") is None
