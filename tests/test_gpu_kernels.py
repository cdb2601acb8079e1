"""The Triton kernels' own schedule (gpu/): what the catalog cannot see from outside.

The catalog checks the kernels through `--impl gpu.paged:paged_attention` (CI runs it under
the Triton interpreter); these tests call `gpu.paged.attention` directly, with schedules
that force many decode splits, and check what only the schedule decides:

| test                                         | what it pins down                                            |
|----------------------------------------------|--------------------------------------------------------------|
| test_plan_follows_the_schedule               | L <= 8: split decode + merge; longer: one prefill; grids from shapes only (no host read) |
| test_decode_bits_do_not_depend_on_the_batch  | a request's split count is its own: its bits alone == in any batch, any table width |
| test_many_splits_meet_the_oracle             | splits merged in order with the sink once, lse, window, soft-cap, ALiBi |
| test_page_tiles_and_gathered_keys_agree_with_the_oracle | one page id per tile (ps % BLOCK_N == 0) and per key |
| test_hidden_non_finite_value_spares_rows_that_do_not_see_it | 0 * NaN of masked lanes in P.V |
| test_page_outside_the_pool_is_never_read     | the net under gpu/checks.py: NaN rows, no read            |
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the Triton kernels take torch tensors (pip install '.[gpu]')")
# gpu/ first: it picks the interpreter before triton is imported (triton reads it then)
pytest.importorskip("gpu.paged", reason="the Triton kernels need triton (pip install '.[gpu]')")

from conformance.bridges import TorchBridge  # noqa: E402
from fixtures import bits, paged_case  # noqa: E402
from gpu import kernels  # noqa: E402
from gpu.paged import Schedule, attention, plan  # noqa: E402
from oracles.compare import compare  # noqa: E402

# small splits, so a few hundred keys already cross many split edges and the cap
SPLITS = Schedule(min_split=32, max_splits=12)


BRIDGE = TorchBridge("cpu", None)  # the torch bridge's own conversions (bf16 moved as bits)


def _tensor(x):
    return BRIDGE.to("array", x)


def _mlx(t):
    return BRIDGE.back(t, None)


def _options(case):
    kw = case.kwargs()
    return {k: _tensor(v) if isinstance(v, mx.array) else v for k, v in kw.items()}


def run(case, schedule=SPLITS):
    """The case through gpu.paged.attention; the result back in MLX (out, or (out, lse))."""
    result = attention(*[_tensor(x) for x in case.args()[:5]], case.page_size, **_options(case), schedule=schedule)
    return tuple(_mlx(r) for r in result) if isinstance(result, tuple) else _mlx(result)


def assert_meets_oracle(case, schedule=SPLITS):
    failures = compare(run(case, schedule), case.args(), case.kwargs()).failures()
    assert not failures, failures


def test_plan_follows_the_schedule():
    case = paged_case(context_lens=[700, 0, 40], query_len=1, q_heads=8, kv_heads=2, head_dim=16, page_size=16,
                      max_pages=50, seed=1)
    args = [_tensor(x) for x in case.args()[:5]]
    _, _, launches = plan(*args, scale=0.25, schedule=SPLITS)
    decode, merge = launches
    assert decode.kernel is kernels.decode_split_kernel and merge.kernel is kernels.merge_kernel
    # the grid's split count comes from the table's width (50 pages * 16 = 800 keys), capped
    assert decode.grid == (3, 2, 12) and merge.grid == (3, 8)
    assert decode.meta["BLOCK_M"] == 16 and decode.meta["G"] == 4
    assert decode.meta["BLOCK_N"] == 16 and decode.meta["PAGE_TILES"]  # float32: 16-key tiles, one page each
    narrow = paged_case(context_lens=[40], query_len=1, q_heads=8, kv_heads=2, head_dim=16, page_size=16, seed=1)
    _, _, (decode, _) = plan(*[_tensor(x) for x in narrow.args()[:5]], scale=0.25, schedule=SPLITS)
    assert decode.grid == (1, 2, 2)  # 3 pages * 16 = 48 keys: two splits of 32 at most
    prefill = paged_case(context_lens=[40, 9], query_len=9, q_heads=8, kv_heads=2, head_dim=16, page_size=64,
                         seed=1)
    _, _, (launch,) = plan(*[_tensor(x) for x in prefill.args()[:5]], scale=0.25, mask="causal", schedule=SPLITS)
    assert launch.kernel is kernels.prefill_kernel and launch.grid == (2, 8, 1) and launch.meta["PAGE_TILES"]


@pytest.mark.parametrize("L", [1, 5])
def test_decode_bits_do_not_depend_on_the_batch(L):
    """Each request alone, in the batch, shuffled and under a wider table (more grid
    splits) gives the same bits: its splits and their merge order are its own."""
    contexts = [300, L, 0, 40, 700]
    big = paged_case(context_lens=contexts, query_len=L, q_heads=8, kv_heads=2, head_dim=32, page_size=16,
                     window=250, seed=6)
    out = run(big)
    for b in range(len(contexts)):
        own = max(1, -(-contexts[b] // 16))
        for width in (own, 60):  # its own pages (fewer grid splits); padded to 60 pages (12 grid splits)
            table = np.array(big.block_table[b:b + 1])[:, :own]
            table = np.pad(table, ((0, 0), (0, width - own)), constant_values=-1)
            alone = big.with_(query=big.query[b:b + 1], block_table=mx.array(table),
                              context_lens=big.context_lens[b:b + 1])
            assert bits(run(alone)) == bits(out[b:b + 1]), f"request {b} (context {contexts[b]}, width {width})"
    order = [4, 0, 3]
    shuffled = big.with_(query=big.query[order], block_table=big.block_table[order],
                         context_lens=big.context_lens[order])
    assert bits(run(shuffled)) == bits(out[order])


@pytest.mark.parametrize("L", [1, 4])
@pytest.mark.parametrize("features", [dict(window=100), dict(softcap=3.0, return_lse=True),
                                      dict(sinks=True, alibi=True, return_lse=True), dict(mask=None)])
def test_many_splits_meet_the_oracle(L, features):
    features = dict(features)
    sinks, alibi = features.pop("sinks", False), features.pop("alibi", False)
    case = paged_case(context_lens=[700, 33, 0, 256], query_len=L, q_heads=8, kv_heads=2, head_dim=32,
                      page_size=16, seed=3, **{k: v for k, v in features.items() if k in ("window", "mask")})
    rng = np.random.default_rng(3)
    case = case.with_(softcap=features.get("softcap"), return_lse=features.get("return_lse", False),
                      sinks=mx.array(rng.normal(size=8).astype(np.float32)) if sinks else None,
                      alibi_slopes=mx.array(2.0 ** -np.arange(1, 9, dtype=np.float32)) if alibi else None)
    assert_meets_oracle(case)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("page_size", [64, 16, 5])
@pytest.mark.parametrize("L", [1, 70])
def test_page_tiles_and_gathered_keys_agree_with_the_oracle(dtype, page_size, L):
    """One page id per tile where the tile size divides the page size (ps 64; ps 16 under
    float32's 16-key tiles), else one per key (tiles cross pages: ps 5, ps 16 in 16-bit)."""
    case = paged_case(context_lens=[200, 0, 90 if L == 1 else 70], query_len=L, q_heads=4, kv_heads=2, head_dim=64,
                      page_size=page_size, dtype=dtype, seed=4)
    _, _, launches = plan(*[_tensor(x) for x in case.args()[:5]], scale=0.125)
    block_n = {"float32": 16}.get(dtype, 64)
    assert launches[0].meta["BLOCK_N"] == block_n and launches[0].meta["PAGE_TILES"] == (page_size % block_n == 0)
    assert_meets_oracle(case)


@pytest.mark.parametrize("L", [1, 3, 20])
def test_hidden_non_finite_value_spares_rows_that_do_not_see_it(L):
    """A context one too long makes its last key (NaN K and V, never written) visible to the
    last row only: every other row of the same tile stays finite."""
    case = paged_case(context_lens=[30], query_len=L, q_heads=4, kv_heads=2, head_dim=16, page_size=16, seed=5)
    too_long = np.array(run(case.with_(context_lens=mx.array([31], dtype=mx.int32))))
    assert np.isnan(too_long[:, :, -1]).all() and np.isfinite(too_long[:, :, :-1]).all()
    values = np.array(case.value_pages)
    values[np.array(case.block_table)[0, 0], :, 3] = np.inf  # position 3: seen by every row
    poisoned = np.array(run(case.with_(value_pages=mx.array(values))))
    assert not np.isfinite(poisoned).any()


@pytest.mark.parametrize("bad_page", [-5, 9, 2 ** 31 - 1])
@pytest.mark.parametrize("L", [1, 20])
def test_page_outside_the_pool_is_never_read(bad_page, L):
    """Past gpu/checks.py (called through plan directly): the rows that see a page id
    outside the pool turn NaN; nothing is dereferenced (the interpreter would read any
    host address, a GPU fault)."""
    case = paged_case(context_lens=[40, 20], query_len=L, q_heads=4, kv_heads=2, head_dim=16, page_size=16,
                      seed=7, extra_pages=0)
    table = np.array(case.block_table)
    table[0, 1] = bad_page  # positions 16..31 of request 0
    args = [_tensor(x) for x in case.args()[:5]]
    args[3] = torch.from_numpy(table)
    out, _, launches = plan(*args, scale=0.25)
    for launch in launches:
        launch.run()
    out = out.numpy()
    assert np.isnan(out[0]).all() and np.isfinite(out[1]).all()
