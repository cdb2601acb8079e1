"""Mixed batches (issue 22, point 2): one-token decode requests beside speculative
requests of grid.MIXED_L rows, in one batch. `paged` serves them with one call per query
length; vllm_cpu with one varlen call (test_operator's test_paths_agree compares the two
where vLLM is installed)."""

import numpy as np
import pytest

import impl
from bench import goals, grid, paths

MIXED = grid.Spec("mixed", 4, 40, 16, "float32", grid.MIXED_L)


def test_mixed_spec_counts_each_requests_own_rows():
    assert MIXED.rows == (1, 1, 4, 4) and grid.Spec("decode", 4, 40, 16, "float32", 1).rows is None
    h, d = grid.SHAPE["q_heads"], grid.SHAPE["head_dim"]
    decode_row, spec_rows = 40, sum(40 - 4 + 1 + l for l in range(4))
    assert MIXED.flops() == 4 * h * d * (2 * decode_row + 2 * spec_rows)
    as_decode = grid.Spec("decode", 4, 40, 16, "float32", 1)
    assert MIXED.io_bytes() - as_decode.io_bytes() == 2 * (2 * 3) * h * d * 4  # Q and O of 6 more rows


def test_paged_serves_a_mixed_batch_with_one_call_per_query_length():
    """Its varlen output is each request attended alone with its own rows: the last
    `rows[b]` positions of its context."""
    case = paths.Pools([MIXED]).case(MIXED)
    run = paths.make("paged", case, MIXED.rows)
    outs = run()
    assert [tuple(o.shape) for o in outs] == [(2, 32, 1, 128), (2, 32, 4, 128)]
    want = []
    for b, r in enumerate(MIXED.rows):
        alone = impl.paged_attention(case.query[b:b + 1, :, -r:], case.key_pages, case.value_pages,
                                     case.block_table[b:b + 1], case.context_lens[b:b + 1], case.page_size)
        want.append(np.array(alone[0].transpose(1, 0, 2)))
    np.testing.assert_array_equal(paths.result(run), np.concatenate(want))


def _case(op, path, speedup):
    return {"op": op, "path": path, "batch": 4, "context": 1024, "page_size": 16, "dtype": "float32",
            "median_s": 1e-3 * (speedup if path == "vllm_cpu" else 1)}


def test_vllm_goals_count_the_mixed_batches():
    cases = [_case(op, path, speedup) for op, speedup in (("decode", 2.0), ("prefill", 1.8), ("mixed", 0.7))
             for path in ("paged", "vllm_cpu")]
    every = next(g for g in goals.evaluate({"cases": cases}) if g["goal"] == goals.VLLM_EVERY_GOAL)
    assert every["measured"] == pytest.approx(0.7) and every["met"] is False
    assert every["detail"].startswith("worst B4 S1024 ps16 float32") and "over 3 cases" in every["detail"]


def test_mixed_paths_skip_the_dense_paths_with_the_reason():
    for path in ("dense_gather", "mlx_sdpa", "torch_sdpa"):
        assert grid.skip_reason(MIXED, path).startswith("a mixed batch (one-token and speculative rows)")
    assert grid.skip_reason(MIXED, "paged") is None
    assert any(s.op == "mixed" for s in grid.attention_specs("smoke"))
    assert {(s.batch, s.context) for s in grid.attention_specs("full") if s.op == "mixed"} == \
        {(b, s) for b in (4, 16) for s in (1024, 8192)}


def test_a_mixed_batch_is_cut_into_runs_of_equal_query_length():
    """Each run of requests keeps its own last rows, cut once outside the timed call."""
    case = paths.Pools([MIXED]).case(MIXED)
    parts = paths.by_query_length(case, MIXED.rows)
    assert [r for r, _ in parts] == [1, 4]
    for (r, part), batch in zip(parts, ([0, 1], [2, 3])):
        assert np.array_equal(np.array(part.query), np.array(case.query)[batch][:, :, -r:])
        assert np.array_equal(np.array(part.block_table), np.array(case.block_table)[batch])
        assert np.array_equal(np.array(part.context_lens), np.array(case.context_lens)[batch])
    [(rows, whole)] = paths.by_query_length(case, None)
    assert rows == grid.MIXED_L and whole is case


def _profile(cases, limits=None) -> str:
    report = {"cases": cases, "limits": limits or {}}
    return next(g for g in goals.evaluate(report) if g["goal"] == goals.VLLM_EVERY_GOAL)["detail"]


def test_a_missed_vllm_goal_says_where_the_time_goes():
    """At the worst shape: both kernels' median, best and p95 calls, their best calls'
    ratio, where ours ran (the MLX stream round trip timed beside a lazy call), the read
    rate of each against the stream timed beside them, and each one's FMA share."""
    timing = {"paged": (1.0e-3, 0.60e-3, 1.5e-3, 8.0, 16.0), "vllm_cpu": (0.5e-3, 0.66e-3, 0.7e-3, 16.0, 32.0)}
    decode = [{**_case("decode", path, 0.5), "round_trip_median_s": 0.4e-3, "min_s": best, "p95_s": p95,
               "bytes": 8e6, "gbytes_per_s": rate, "read_gbytes_per_s": 10.0, "gflops": gflops}
              for path, (_, best, p95, rate, gflops) in timing.items()]
    assert _profile(decode, {"fma_gflops": 64.0}).endswith(
        "there paged took 1.000 ms (best 0.600, p95 1.500), vllm_cpu 0.500 ms (best 0.660, p95 0.700); best calls "
        "1.10x: the medians' gap is the calls' spread, not the kernel at its best; 0.400 ms of paged's median is the "
        "MLX stream round trip (a trivial op timed beside it; vLLM's op runs in the calling thread); 8.00 MB a call "
        "at 8.0 and 16.0 GB/s against the 10.0 GB/s read stream timed beside them; paged ran at 25% of the FMA "
        "peak, vllm_cpu at 50%")
    cached = [{**c, "path": "paged_now", "gbytes_per_s": 12.0, "min_s": 0.8e-3} if c["path"] == "paged" else c
              for c in decode]
    assert _profile(cached).endswith(
        "there paged_now took 1.000 ms (best 0.800, p95 1.500), vllm_cpu 0.500 ms (best 0.660, p95 0.700); best "
        "calls 0.82x, so slower at its best too; paged_now runs in the calling thread, as vLLM's op (its checks "
        "included); 8.00 MB a call at 12.0 and 16.0 GB/s against the 10.0 GB/s read stream timed beside them: "
        "both above it, from cache")
    prefill = [{**_case("prefill", path, 0.7), "fma_fraction": share} for path, share in (("paged", 0.43),
                                                                                          ("vllm_cpu", 0.61))]
    assert _profile(prefill).endswith("there paged took 1.000 ms, vllm_cpu 0.700 ms; paged ran at 43% of the FMA "
                                      "peak, vllm_cpu at 61%")
    met = [_case("decode", path, 1.2) for path in ("paged", "vllm_cpu")]
    every = next(g for g in goals.evaluate({"cases": met}) if g["goal"] == goals.VLLM_EVERY_GOAL)
    assert every["met"] and "there paged" not in every["detail"]
