"""The write path: appending K/V rows into the pool in place, at two pool sizes.

| case               | rows written (K and V, 8 heads, D 128, f32, pages of 16) | bytes     |
|--------------------|-----------------------------------------------------------|-----------|
| 1-token append     | 1                                                         | 8 KiB     |
| 128-token chunk    | 128 (a prefill step; crosses 8 or 9 pages)                 | 1 MiB     |

Each is timed in a 64 MiB and a 1 GiB pool, interleaved call by call in one loop, so the
ratio (1 GiB / 64 MiB, goal <= 1.2) sees the same machine load: a functional update would
copy the whole layer per write and cost ~16x more in the larger pool. `pool_copies()` must
not move (no write fell back to a whole-pool copy).
"""

from __future__ import annotations

import mlx.core as mx

from fixtures.serving_bench import WRITE_SHAPE, write_pool
from impl.pool import pool_copies

from . import timing

POOL_MIB = (64, 1024)
TOKENS = (1, 128)
GOAL_RATIO = 1.2
ROUNDS = {"smoke": 5, "quick": 400, "full": 2000}


def setup(mib: int):
    """(pool, {tokens: slots}): a one-layer pool of `mib` MiB (fixtures.serving_bench) and
    slots reserved for each write size, one after the other in one request."""
    pool, cache, one = write_pool(mib)
    return pool, {n: one if n == 1 else cache.reserve(n) for n in TOKENS}, cache


def writer(made, tokens: int):
    """A callable that writes `tokens` rows (K and V) at their slots and evaluates the pool."""
    pool, slots, _ = made
    rows = mx.ones((tokens, WRITE_SHAPE["kv_heads"], WRITE_SHAPE["head_dim"]), dtype=pool.dtype)
    mx.eval(rows)
    prepared = pool.prepare_slots(slots[tokens])

    def write():
        pool.write(0, prepared, rows, rows)
        mx.eval(pool.keys(0), pool.values(0))
    return write


def row_bytes(tokens: int, dtype=mx.float32) -> int:
    return 2 * tokens * WRITE_SHAPE["kv_heads"] * WRITE_SHAPE["head_dim"] * dtype.size


def interleaved(writes: dict, rounds: int) -> dict:
    """{key: [seconds]}: every callable once per round, in turn, after one warm-up each.
    Raises if any write copied a whole pool."""
    before = pool_copies()
    for write in writes.values():
        write()
    times = {key: [] for key in writes}
    for _ in range(rounds):
        for key, write in writes.items():
            times[key].append(timing.timed(write))
    if pool_copies() != before:
        raise AssertionError("a write copied the whole pool instead of writing in place")
    return times


def run(level: str) -> list[dict]:
    """One row per (tokens, pool size), with the 1 GiB / 64 MiB ratio of the medians."""
    made = {mib: setup(mib) for mib in POOL_MIB}
    rows = []
    for n in TOKENS:
        times = interleaved({mib: writer(made[mib], n) for mib in POOL_MIB}, ROUNDS[level])
        medians = {mib: timing.summary(t)["median_s"] for mib, t in times.items()}
        for mib, t in times.items():
            rows.append({"op": "write", "path": "paged", "tokens": n, "pool_mib": mib,
                         "page_size": WRITE_SHAPE["page_size"], "dtype": "float32", "bytes": row_bytes(n),
                         **timing.summary(t), "ratio_vs_smallest_pool": medians[mib] / medians[POOL_MIB[0]]})
    return rows
