"""Small decode calls as a model step makes them: alone, or a layer stack's worth in one
graph (issue 22, points 2 and 4: where small-batch latency goes).

Every call through MLX hands its primitive to the kernels' stream thread and waits for
it: the round trip (machine.StreamRoundTrip; on the 2-core KVM guest ~15 us between
kernel calls, ~0.1 ms once the vCPUs have gone idle) that the grid's small decode cases
pay once per call, and vLLM's op, run in the calling thread, never pays. A model step
builds its whole graph and evaluates it once, so its LAYERS attention calls share one
round trip. Both are timed here in turns, beside LAYERS vLLM calls in a row (its
per-layer cost in a step); measured 2026-12-02, a call in the graph cost about as much
as one alone, so the round trip is not what small calls lose on:

| field                       | meaning                                                         |
|-----------------------------|-----------------------------------------------------------------|
| `alone_median_s`            | one `paged_attention_with_metadata` call evaluated alone (the grid's `paged`) |
| `in_graph_median_s`         | per call: LAYERS calls, each with its own query, evaluated together |
| `vllm_cpu_median_s`         | per call: LAYERS vLLM calls in a row (absent, with `vllm_cpu_skipped`, where its ops do not load) |
| `vllm_over_alone`, `vllm_over_in_graph` | vLLM / pagecheck per call (above 1: pagecheck faster) |
"""

from __future__ import annotations

import mlx.core as mx

import impl

from . import grid, paths, timing

LAYERS = 32  # Qwen3-4B's 36 layers, rounded to a power of two
SPECS = (grid.Spec("decode", 1, 128, 16, "float32", 1), grid.Spec("decode", 1, 1024, 16, "float32", 1),
         grid.Spec("decode", 1, 1024, 16, "bfloat16", 1), grid.Spec("decode", 4, 128, 16, "float32", 1))


def stack(case):
    """A zero-argument callable: LAYERS calls on `case`'s pool, each with its own query,
    evaluated together; returns their outputs."""
    meta = impl.PagedMetadata.build(case.block_table, case.context_lens, page_size=case.page_size,
                                    num_pages=case.key_pages.shape[0], query_len=case.query.shape[2])
    queries = [mx.random.normal(case.query.shape, key=mx.random.key(layer)).astype(case.query.dtype)
               for layer in range(LAYERS)]
    mx.eval(*queries)

    def run():
        outs = [impl.paged_attention_with_metadata(q, case.key_pages, case.value_pages, meta) for q in queries]
        mx.eval(*outs)
        return outs
    run.queries = queries
    return run


def run(level: str) -> list[dict]:
    """One row per spec of SPECS (smoke: the first only)."""
    specs = SPECS[:1] if level == "smoke" else SPECS
    pools, rows = paths.Pools(specs), []
    for spec in specs:
        case = pools.case(spec)
        runs = {"alone": paths.make("paged", case), "in_graph": stack(case)}
        skipped = grid.skip_reason(spec, "vllm_cpu")
        if skipped is None:
            one = paths.make("vllm_cpu", case)
            runs["vllm_cpu"] = lambda one=one: [one() for _ in range(LAYERS)]
        times = timing.side_by_side(runs, level)
        med = {name: timing.summary(t)["median_s"] / (1 if name == "alone" else LAYERS) for name, t in times.items()}
        row = {**spec.describe(), "layers": LAYERS, **{f"{name}_median_s": m for name, m in med.items()}}
        if skipped is None:
            row.update(vllm_over_alone=med["vllm_cpu"] / med["alone"], vllm_over_in_graph=med["vllm_cpu"] / med["in_graph"])
        else:
            row["vllm_cpu_skipped"] = skipped
        rows.append(row)
    return rows


def lines(rows: list[dict]) -> list[str]:
    """The report's and the README's lines for these rows."""
    out = []
    for r in rows:
        vllm = (f"; vLLM {r['vllm_cpu_median_s'] * 1e3:.3f} ms a call ({r['vllm_over_alone']:.2f}x / "
                f"{r['vllm_over_in_graph']:.2f}x)" if "vllm_cpu_median_s" in r else
                f"; vllm_cpu skipped: {r['vllm_cpu_skipped']}")
        out.append(f"decode B{r['batch']} S{r['context']} ps{r['page_size']} {r['dtype']}: paged "
                   f"{r['alone_median_s'] * 1e3:.3f} ms alone, {r['in_graph_median_s'] * 1e3:.3f} ms a call in a "
                   f"graph of {r['layers']}{vllm}")
    return out
