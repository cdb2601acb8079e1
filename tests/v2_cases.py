"""The small paged calls the contract-v2 oracle tests share (tests/test_oracles_v2.py,
tests/test_oracles_v2_by_hand.py): their heads and lengths, ALiBi slopes and sinks exact
in every dtype or not, and `v2_case`, a random layout (fixtures/layouts.py) whose value
pages may have another head dim than its keys."""

import mlx.core as mx
import numpy as np

import oracles
from fixtures import paged_case

ORACLES = sorted(oracles.MLX_ORACLES)
Hq, Hkv, DK, DV = 4, 2, 8, 6
LENS, L = [13, 0, 6], 3


def f32(values) -> mx.array:
    return mx.array(np.array(values, dtype=np.float32))


POW2_SLOPES = [2.0 ** -(h + 1) for h in range(Hq)]  # ALiBi's own slopes: exact in every dtype
ODD_SLOPES = [0.3, 0.17, 0.071, 0.0123]  # not exact in float16 / bfloat16
EXACT_SINKS = [0.5, -1.0, 2.0, 0.25]
ODD_SINKS = [0.3, -1.3, 2.7, 0.01]

def v2_case(options: dict, *, dtype="float32", dv=DV, lens=LENS, query_len=L, head_dim=DK, page_size=4,
            seed=5, **layout):
    """A paged layout (fixtures/layouts.py) with value pages of head dim `dv`: the value
    pool of the same layout (same seed: same table, same NaN slots) drawn at dv."""
    case = paged_case(context_lens=lens, query_len=query_len, q_heads=Hq, kv_heads=Hkv, head_dim=head_dim,
                      page_size=page_size, dtype=dtype, seed=seed, **layout)
    if dv != head_dim:
        other = paged_case(context_lens=lens, query_len=query_len, q_heads=Hq, kv_heads=Hkv, head_dim=dv,
                           page_size=page_size, dtype=dtype, seed=seed, **layout)
        assert np.array_equal(np.array(other.block_table), np.array(case.block_table))
        case = case.with_(value_pages=other.value_pages)
    opts = {k: (f32(v) if k in ("alibi_slopes", "sinks") else v) for k, v in options.items()}
    return case.with_(**opts)
