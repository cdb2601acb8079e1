"""Per-call overhead of `paged_attention` over the serving path (issue 22, point 4).

`paged_attention` checks every argument on every call, the values of the block table
and context lengths included (one compiled pass over the arrays where they lie,
impl/csrc/metadata_check.h); `paged_attention_with_metadata` takes a `PagedMetadata`
checked once. On the same inputs the two run the same kernel, so the difference of
their medians is what checking the metadata costs a call:

| field                  | meaning                                                            |
|------------------------|--------------------------------------------------------------------|
| `paged_median_s`       | `paged_attention` + eval                                           |
| `with_metadata_median_s` | `paged_attention_with_metadata` (metadata built once) + eval     |
| `overhead_s`           | `paged_median_s - with_metadata_median_s` (goal at B 1: <= 20 us, bench/goals.py) |
| `paged_host_median_s`  | the `paged_attention` call alone, up to its lazy output: all checks and the graph node, right after the previous call's kernel |
| `with_metadata_host_median_s` | the same for `paged_attention_with_metadata`                |
| `validation_median_s`  | everything `paged_attention` does before the primitive, alone      |
| `build_median_s`       | `PagedMetadata.build` alone (the serving path's, once a step)      |

The two calls are timed once each per round, in turn (like bench/write.py), so a burst
of load from another job lands on both alike; the checks alone are timed the same way in
a loop of their own. Right after a kernel call the caches hold K/V, not Python's working
set, so the same checks take 1.5-4x their time in a loop of their own (measured on the
2-core EPYC, 2026-12-02: the NumPy checks of before were 13.9 us alone, 22 us after a
kernel call, 58 us after a 16 MiB NumPy sum); `*_host_median_s` is what a caller
sees. Cases: Hq 32, Hkv 8, D 128, one new token, S 1024, pages of 16, float32, at B 1
(the goal) and B 16 (where the kernel's ~10 ms make the difference noisy: reported, not
judged).
"""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np

import impl
from impl.checked import checked_contract_call
from impl.validation import PagedMetadata, check_metadata_dtype, check_metadata_values

from . import timing
from .grid import SHAPE

BATCHES = (1, 16)
CONTEXT, PAGE_SIZE, DTYPE = 1024, 16, "float32"
GOAL_BATCH = 1
# rounds at B 1; B 16 gets a tenth (its kernel is ~50x slower)
ROUNDS = {"smoke": 5, "quick": 1500, "full": 5000}
CALLS = ("paged", "with_metadata")
CHECKS = ("validation", "build")


def setup(batch: int):
    """(query, key_pages, value_pages, block_table, context_lens): `batch` requests of
    CONTEXT positions over their own pages, evaluated."""
    pages = CONTEXT // PAGE_SIZE
    P = batch * pages
    key = mx.random.key(batch)
    kp = mx.random.normal((P, SHAPE["kv_heads"], PAGE_SIZE, SHAPE["head_dim"]), key=key)
    vp = mx.random.normal((P, SHAPE["kv_heads"], PAGE_SIZE, SHAPE["head_dim"]), key=mx.random.split(key)[0])
    q = mx.random.normal((batch, SHAPE["q_heads"], 1, SHAPE["head_dim"]), key=mx.random.split(key)[1])
    table = mx.array(np.random.default_rng(batch).permutation(P).astype(np.int32).reshape(batch, pages))
    lens = mx.array(np.full(batch, CONTEXT, dtype=np.int32))
    args = tuple(x.astype(getattr(mx, DTYPE)) for x in (q, kp, vp)) + (table, lens)
    mx.eval(*args)
    return args


def callables(args) -> dict:
    """{name: zero-argument callable} for the paths compared (see the module docstring):
    the two calls return their lazy output, the checks nothing."""
    q, kp, vp, table, lens = args
    meta = PagedMetadata.build(table, lens, page_size=PAGE_SIZE, num_pages=kp.shape[0], query_len=q.shape[2])

    def paged():
        return impl.paged_attention(q, kp, vp, table, lens, PAGE_SIZE)

    def with_metadata():
        return impl.paged_attention_with_metadata(q, kp, vp, meta)

    def validation():  # impl/attention.py paged_attention, up to the primitive (its checks remembered)
        options = (None, "causal", None, None, None, None, False, None, None, None)
        geom, _ = checked_contract_call(q, kp, vp, table, lens, PAGE_SIZE, options)
        check_metadata_values(check_metadata_dtype("block_table", table), check_metadata_dtype("context_lens", lens),
                              page_size=geom.page_size, num_pages=geom.num_pages, query_len=geom.query_len)

    def build():
        PagedMetadata.build(table, lens, page_size=PAGE_SIZE, num_pages=kp.shape[0], query_len=q.shape[2])

    return {"paged": paged, "with_metadata": with_metadata, "validation": validation, "build": build}


def interleaved(runs: dict, rounds: int) -> dict:
    """{name: [seconds]}: every callable once per round, in turn, after untimed warm-up."""
    for fn in runs.values():
        timing.settle(fn)
    times = {name: [] for name in runs}
    for _ in range(rounds):
        for name, fn in runs.items():
            times[name].append(timing.timed(fn))
    return times


def interleaved_calls(calls: dict, rounds: int) -> dict:
    """{name: [seconds], name_host: [seconds]}: each call and its eval, once per round
    in turn; `_host` is the call alone, up to its lazy output."""
    for fn in calls.values():
        timing.settle(lambda: mx.eval(fn()))
    times = {key: [] for name in calls for key in (name, f"{name}_host")}
    for _ in range(rounds):
        for name, fn in calls.items():
            t0 = time.perf_counter()
            out = fn()
            t1 = time.perf_counter()
            mx.eval(out)
            t2 = time.perf_counter()
            times[name].append(t2 - t0)
            times[f"{name}_host"].append(t1 - t0)
    return times


def run(level: str) -> list[dict]:
    """One row per batch size."""
    rows = []
    for batch in BATCHES:
        rounds = ROUNDS[level] if batch == GOAL_BATCH else max(ROUNDS["smoke"], ROUNDS[level] // 10)
        runs = callables(setup(batch))
        # the checks alone in a loop of their own: right after a kernel call its worker
        # threads still spin for a while, which would slow them several times over
        times = {**interleaved_calls({k: runs[k] for k in CALLS}, rounds),
                 **interleaved({k: runs[k] for k in CHECKS}, ROUNDS[level])}
        med = {name: timing.summary(t)["median_s"] for name, t in times.items()}
        rows.append({"op": "overhead", "path": "paged", "batch": batch, "context": CONTEXT,
                     "page_size": PAGE_SIZE, "dtype": DTYPE, "query_len": 1, "rounds": rounds,
                     **{f"{name}_median_s": m for name, m in med.items()},
                     "overhead_s": med["paged"] - med["with_metadata"]})
    return rows
