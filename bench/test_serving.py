"""Smoke test of the serving trace's command line (`python -m bench.serving --quick`):
the report has every field the JSON promises, the variants agree, nothing leaks."""

import json

from bench.serving import main

FIELDS = {"prefill_tok_s", "decode_tok_s", "requests_s", "decode_step_ms", "peak_kv_bytes", "peak_kv_fitted_bytes",
          "peak_kv_filled_bytes",
          "peak_live_pages", "kv_bytes_copied", "page_reuses", "tail_waste_slots", "leaked_pages"}


def test_quick_trace_report(tmp_path, capsys):
    path = tmp_path / "serving.json"
    assert main(["--quick", "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    assert set(report["variants"]) == {"paged", "paged_gather", "dense"}
    for name, metrics in report["variants"].items():
        assert FIELDS <= set(metrics), name
        assert set(metrics["decode_step_ms"]) == {"median", "p95", "max"}
        assert metrics["leaked_pages"] == 0 and metrics["whole_pool_copies"] == 0
    assert report["outputs_agree"] and report["positions_checked"] > 0
    dense = report["variants"]["dense"]
    # static slots cover the fitted reservations, which cover what is written
    assert dense["peak_kv_bytes"] >= dense["peak_kv_fitted_bytes"] >= dense["peak_kv_filled_bytes"]
    paged = report["variants"]["paged"]
    assert paged["peak_kv_bytes"] == paged["peak_kv_fitted_bytes"] == paged["peak_kv_filled_bytes"]
    assert len(report["trace"]["digest"]) == 16
    sweep = report["admission_sweep"]
    assert sweep and all(row["paged"]["peak_running"] >= row["dense"]["peak_running"] for row in sweep)
    assert "outputs agree bit for bit" in capsys.readouterr().out
