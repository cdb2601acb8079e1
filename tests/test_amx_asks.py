"""The bfloat16 tile walk's asks for the rows it reads next (impl/csrc/amx_chunk.h `Ahead`,
amx.cpp): made only where a call's K/V exceed 64 MiB (`kTileAskKvBytes`: below it they cost
more than they hide), and they change no bit. Skipped where the AMX tiles are not supported.

| what must hold                                                        | test                          |
|-----------------------------------------------------------------------|-------------------------------|
| a call beyond 64 MiB asks, a call within it does not                  | test_walk_asks_beyond_the_cache |
| asking changes no bit: a request alone (within 64 MiB) equals its rows in a batch beyond it | test_walk_asks_beyond_the_cache |
| the asks are in the walk's machine code at all (GCC dropped them once) | bench/test_amx_loops.py::test_walk_asks_in_its_code |
"""

import pytest

import impl
import pagecheck_kernels
from fixtures import bits, paged_case
from tests.tile_path import tile_path

pytestmark = [pytest.mark.correctness, pytest.mark.builtin_only("the built-in kernel's AMX tile walk")]

ASK_KV_BYTES = 64 << 20  # amx.cpp kTileAskKvBytes
CONTEXT = 9000  # 8 KV heads x (128 + 128) bf16 a position: 36.9 MB alone, 73.7 MB for two


@pytest.mark.parametrize("page_size, query_len", [(16, 1), (128, 1), (16, 8)],
                         ids=["decode-keys-in-place", "decode-pages-of-128", "rows-of-8-positions-packed-keys"])
def test_walk_asks_beyond_the_cache(page_size, query_len):
    case = paged_case(context_lens=[CONTEXT, CONTEXT], query_len=query_len, q_heads=32, kv_heads=8, head_dim=128,
                      page_size=page_size, dtype="bfloat16", seed=11)
    alone = case.with_(query=case.query[:1], block_table=case.block_table[:1], context_lens=case.context_lens[:1])
    per_position = 8 * (128 + 128) * 2
    assert CONTEXT * per_position <= ASK_KV_BYTES < 2 * CONTEXT * per_position
    with tile_path(True):
        before = pagecheck_kernels.tile_walks_asking()
        first = bits(alone.run(impl.paged_attention))
        assert pagecheck_kernels.tile_walks_asking() == before, "a call within 64 MiB asked"
        batch = case.run(impl.paged_attention)
        asked = pagecheck_kernels.tile_walks_asking() - before
    chunks = 2 * -(-CONTEXT // pagecheck_kernels.CHUNK)
    assert asked >= chunks, f"a call beyond 64 MiB asked in {asked} walks, not in each of its {chunks} chunks"
    assert first == bits(batch[:1]), "asking for the next rows changed request 0's bits"
