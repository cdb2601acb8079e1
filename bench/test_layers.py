"""bench/layers.py: small decode calls alone and a layer stack's worth in one graph."""

import numpy as np
import pytest

import impl
from bench import grid, layers, paths, timing


def test_a_stack_computes_each_layers_call_as_alone():
    spec = layers.SPECS[0]
    case = paths.Pools([spec]).case(spec)
    stack = layers.stack(case)
    outs = stack()
    assert len(outs) == len(stack.queries) == layers.LAYERS
    meta = impl.PagedMetadata.build(case.block_table, case.context_lens, page_size=case.page_size,
                                    num_pages=case.key_pages.shape[0], query_len=1)
    for q, out in zip(stack.queries[::7], outs[::7]):
        alone = impl.paged_attention_with_metadata(q, case.key_pages, case.value_pages, meta)
        assert np.array_equal(np.array(out), np.array(alone))
    assert not np.array_equal(np.array(outs[0]), np.array(outs[1])), "each layer has its own query"


def test_rows_give_the_time_of_one_call(monkeypatch):
    """The stacks' times are per call (over LAYERS), the single call's as timed."""
    monkeypatch.setattr(timing, "side_by_side", lambda runs, level: {
        "alone": [2e-4], "in_graph": [layers.LAYERS * 5e-5], "vllm_cpu": [layers.LAYERS * 1e-4]})
    monkeypatch.setattr(grid, "skip_reason", lambda spec, path: None)
    monkeypatch.setattr(paths, "make", lambda path, case, rows=None: lambda: None)
    [row] = layers.run("smoke")
    assert (row["alone_median_s"], row["in_graph_median_s"], row["vllm_cpu_median_s"]) == pytest.approx(
        (2e-4, 5e-5, 1e-4))
    assert (row["vllm_over_alone"], row["vllm_over_in_graph"]) == pytest.approx((0.5, 2.0))
    assert layers.lines([row]) == ["decode B1 S128 ps16 float32: paged 0.200 ms alone, 0.050 ms a call in a graph "
                                   "of 32; vLLM 0.100 ms a call (0.50x / 2.00x)"]


def test_smoke_row_times_both_and_says_why_vllm_is_missing():
    [row] = layers.run("smoke")
    assert row["alone_median_s"] > 0 and row["in_graph_median_s"] > 0 and row["layers"] == layers.LAYERS
    assert ("vllm_cpu_median_s" in row) != ("vllm_cpu_skipped" in row)
