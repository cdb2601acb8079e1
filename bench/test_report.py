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
    assert smoke_report["limits"]["read_gbytes_per_s"] > 0 and smoke_report["limits"]["sgemm_gflops"] > 0
    ops = {c["op"] for c in smoke_report["cases"]}
    assert ops == {"decode", "prefill", "write"}
    for c in smoke_report["cases"]:
        assert "skipped" in c or (c["median_s"] > 0 and c["p95_s"] >= c["median_s"]), c
        if "median_s" in c and c["op"] == "decode":
            assert 0 < c["bandwidth_fraction"] and c["gbytes_per_s"] > 0
        if "median_s" in c and c["op"] == "prefill":
            assert 0 < c["flops_fraction"] and c["gflops"] > 0
        if "median_s" in c and c["op"] != "write":
            assert c["paged_speedup"] > 0
    assert [g["goal"] for g in smoke_report["goals"]] == [g["goal"] for g in goals.evaluate(smoke_report)]
    assert report.table(smoke_report)


def test_readme_region_is_generated(tmp_path, smoke_report):
    path = tmp_path / "README.md"
    path.write_text(README)
    readme.rewrite(str(path), smoke_report)
    first = path.read_text()
    assert first.index("## Benchmarks") < first.index(readme.BEGIN) < first.index(readme.END) < first.index("## Status")
    assert "| goal | measured | target | verdict |" in first
    readme.rewrite(str(path), smoke_report)
    assert path.read_text() == first, "rewriting from the same report changes nothing"


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib not installed (extra bench)")
def test_plot(tmp_path, smoke_report):
    from bench.plot import plot
    png = tmp_path / "latency.png"
    message = plot(smoke_report, str(png))
    assert message.startswith("plot written"), message
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
