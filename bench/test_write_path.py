"""The write path is O(tokens written): a 1-token append (and a 128-token chunk) costs the
same in a 64 MiB and a 1 GiB pool (`pytest --benchmark-only bench/test_write_path.py`).

A functional update would copy the whole layer per write (16x more bytes for the larger
pool); the pool's donating primitive writes the new rows in place. The ratio test times
both pools interleaved in one run (bench/write.py) and holds the goal, ratio <= 1.2;
every run (timed or not) also checks that no write fell back to a whole-pool copy.
"""

import statistics

import pytest

from bench import write
from impl.pool import pool_copies


@pytest.fixture(scope="module")
def pools():
    made = {mib: write.setup(mib) for mib in write.POOL_MIB}
    yield made
    made.clear()


@pytest.mark.parametrize("tokens", write.TOKENS)
@pytest.mark.parametrize("mib", write.POOL_MIB)
def test_append(benchmark, pools, mib, tokens):
    before = pool_copies()
    benchmark.group = f"append {tokens} token(s) (K and V, 8 heads, D=128)"
    benchmark.extra_info.update(pool_mib=mib, tokens=tokens, bytes=write.row_bytes(tokens))
    benchmark(write.writer(pools[mib], tokens))
    assert pool_copies() == before


@pytest.mark.parametrize("tokens", write.TOKENS)
def test_append_cost_does_not_grow_with_the_pool(benchmark, pools, tokens):
    small, large = write.POOL_MIB
    writes = {mib: write.writer(pools[mib], tokens) for mib in write.POOL_MIB}
    times = write.interleaved(writes, write.ROUNDS["smoke" if benchmark.disabled else "full"])
    ratio = statistics.median(times[large]) / statistics.median(times[small])
    benchmark.extra_info.update(tokens=tokens, ratio_1GiB_over_64MiB=ratio,
                                **{f"median_us_{m}MiB": statistics.median(t) * 1e6 for m, t in times.items()})
    benchmark.pedantic(writes[small], rounds=1, iterations=1)
    if not benchmark.disabled:
        assert ratio <= write.GOAL_RATIO, \
            f"{tokens}-token append: 1 GiB pool / 64 MiB pool = {ratio:.2f} > {write.GOAL_RATIO}"
