"""The long-prefill sweep (issue 22, point 6): L = S = 8192 in the full grid and alone as
`python -m bench.report --level long`, with its own README region. Its real cases take
seconds each, so the pipeline is run here on a stand-in grid of one small prefill."""

import json

import pytest

from bench import grid, readme, report

LONG = grid.Spec("prefill", 1, grid.LONG_PREFILL, 16, "float32", grid.LONG_PREFILL)


def test_long_level_is_the_8192_prefill_row_at_both_page_sizes_and_dtypes():
    long = grid.attention_specs("long")
    assert sorted((s.op, s.batch, s.context, s.query_len, s.page_size, s.dtype) for s in long) == sorted(
        ("prefill", 1, 8192, 8192, ps, dt) for ps in (16, 128) for dt in ("float32", "bfloat16"))
    assert set(long) <= set(grid.attention_specs("full"))
    assert not set(long) & set(grid.attention_specs("quick"))


def test_long_prefill_skips_only_the_unfused_mlx_paths_with_their_cost():
    """torch SDPA, vLLM CPU (when loadable) and the quantized paths are timed; the two
    paths that materialize the [Hq, L, S] scores say why not, with the memory."""
    skipped = {path: grid.skip_reason(LONG, path) for path in grid.PATHS}
    assert skipped["mlx_sdpa"].startswith("MLX CPU SDPA prefill above L = 512") and "8 GiB" in skipped["mlx_sdpa"]
    assert skipped["dense_gather"].startswith("dense_gather prefill above L = 2048") and "8 GiB" in \
        skipped["dense_gather"]
    for path in ("paged", "paged_fp8", "paged_int8"):
        assert skipped[path] is None, path
    at_2048 = grid.Spec("prefill", 1, 2048, 16, "float32", 2048)
    assert grid.skip_reason(at_2048, "dense_gather") is None


@pytest.fixture(scope="module")
def long_report():
    small = [grid.Spec("prefill", 1, 64, 16, "float32", 64)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(grid, "attention_specs", lambda level: small if level == "long" else pytest.fail(level))
        return json.loads(json.dumps(report.run("long", log=lambda _: None)))


def test_long_run_times_the_sweep_alone(long_report):
    assert long_report["level"] == "long"
    assert {c["op"] for c in long_report["cases"]} == {"prefill"}
    assert not {"overhead", "serving"} & set(long_report)
    paged = [c for c in long_report["cases"] if c["path"] == "paged"]
    assert len(paged) == 1 and paged[0]["median_s"] > 0 and paged[0]["rounds"] >= 2


def test_long_report_has_its_own_readme_region(tmp_path, long_report):
    path = tmp_path / "README.md"
    path.write_text(f"# p\n\n## Benchmarks\n\n{readme.BEGIN}\nthe full grid's results\n{readme.END}\n\n## Status\n")
    readme.rewrite(str(path), long_report)
    text = path.read_text()
    assert f"{readme.BEGIN}\nthe full grid's results\n{readme.END}\n\n{readme.LONG_BEGIN}\n" in text
    region = text.split(readme.LONG_BEGIN)[1].split(readme.LONG_END)[0]
    assert region.lstrip("\n").startswith("<!-- generated") and "Long grid" in region
    assert "Decode (" not in region and "| float32 | 1 | 64 | 16 |" in region
    assert "not measured" not in region, "the sweep lists only the goals it measured"
    readme.rewrite(str(path), long_report)
    assert path.read_text() == text, "rewriting from the same report changes nothing"
