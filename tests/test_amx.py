"""The bfloat16 tile path (impl/csrc/amx.h): a second canonical arithmetic, checked on
its own. Skipped where the AMX tiles are not supported (tests/tile_path.py).

| what must hold on the tiles                                   | test                                      |
|---------------------------------------------------------------|-------------------------------------------|
| the tolerance rule against the oracles, every tile layout     | test_tiles_meet_the_tolerance             |
| ... and with a negative scale                                 | test_tiles_meet_the_tolerance_with_a_n... |
| the switch really changes the arithmetic; off is the FMA path | test_switch_chooses_the_arithmetic        |
| every prefill row equals its decode (invariant 8), windows,   | test_prefill_rows_equal_their_decode      |
| groups of 1-4 (scores by permutes) and 8 (by gathers),        |                                           |
| and sums that the tiles flush to zero                         | test_flushed_sums_stay_equal              |
| keys in place (decode) and packed (prefill) give equal rows   | test_schedules_agree_on_tiles             |
| thread and batch invariance (invariants 6, 7)                 | test_thread_and_batch_invariance          |
| unused slots never change a bit, also when read in place      | test_unused_slots_change_nothing          |
"""

import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

import impl
import pagecheck_kernels
from fixtures import bits, paged_case, to_numpy
from oracles.compare import compare
from tests.tile_path import tile_path

pytestmark = [pytest.mark.correctness, pytest.mark.builtin_only("the built-in kernel's AMX tile path")]

CHUNK = pagecheck_kernels.CHUNK

# (context_lens, query_len, q_heads, kv_heads, head_dim, page_size, window, mask): each
# reaches another part of amx.cpp.
LAYOUTS = {
    "decode-keys-in-place": ([300, 0, 17], 1, 8, 2, 64, 16, None, "causal"),
    "decode-rows-of-8-positions": ([520, 9], 8, 8, 2, 32, 8, None, "causal"),  # 32 rows a head: packed keys
    "prefill-partial-last-block": ([700, 300], 300, 8, 2, 128, 16, None, "causal"),
    "prefill-window-pages-of-5": ([290], 40, 4, 1, 128, 5, 100, "causal"),  # keys copied, rows see no key
    "prefill-group-8-pages-of-128": ([600, 33], 33, 16, 2, 64, 128, None, "causal"),
    "prefill-one-row-tile": ([100], 9, 1, 1, 64, 16, 7, "causal"),  # 9 rows: keys in place in a prefill
    "full-mask-head-dim-96": ([200, 50], 20, 4, 2, 96, 16, None, None),
    "decode-pages-of-1": ([70, 3], 1, 4, 4, 32, 1, None, "causal"),
}


def layout_case(name, seed=5, **changes):
    lens, L, hq, hkv, d, ps, window, mask = LAYOUTS[name]
    kwargs = dict(context_lens=lens, query_len=L, q_heads=hq, kv_heads=hkv, head_dim=d, page_size=ps,
                  window=window, mask=mask, dtype="bfloat16", seed=seed)
    return paged_case(**{**kwargs, **changes})


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_tiles_meet_the_tolerance(name, error_log):
    case = layout_case(name)
    with tile_path(True):
        out = case.run(impl.paged_attention)
    result = compare(out, case.args(), case.kwargs())
    error_log.record(case.dtype, "float64", result.against_float64)
    assert not result.failures(), result.failures()


@pytest.mark.parametrize("name", ["decode-keys-in-place", "prefill-window-pages-of-5"])
def test_tiles_meet_the_tolerance_with_a_negative_scale(name):
    """A negative scale flips the scores' sign before the max (numerics.h's rule)."""
    case = layout_case(name, scale=-0.3)
    with tile_path(True):
        out = case.run(impl.paged_attention)
    assert not compare(out, case.args(), case.kwargs()).failures()


def test_switch_chooses_the_arithmetic():
    """On and off give different bits (the tiles multiply bf16 weights), both within the
    tolerance; the setting reads back and is restored."""
    case = layout_case("prefill-partial-last-block")
    with tile_path(True):
        assert impl.amx_enabled()
        tiles = case.run(impl.paged_attention)
    with tile_path(False):
        assert not impl.amx_enabled()
        fma = case.run(impl.paged_attention)
    assert bits(tiles) != bits(fma)
    for out in (tiles, fma):
        assert not compare(out, case.args(), case.kwargs()).failures()


@pytest.mark.parametrize("bad", [1, "on", None])
def test_set_amx_takes_only_a_bool(bad):
    before = impl.amx_enabled()
    with pytest.raises(ValueError, match="True or False"):
        impl.set_amx(bad)
    assert impl.amx_enabled() == before


def test_set_amx_on_where_unsupported_is_an_error():
    if impl.amx_supported():
        pytest.skip("the tiles are supported here")
    with pytest.raises(ValueError, match="not available"):
        impl.set_amx(True)
    assert not impl.amx_enabled()


def test_env_var_switches_the_tiles_off():
    code = "import impl; print(impl.amx_enabled())"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PAGECHECK_AMX": "0"}, check=True,
                         capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(__file__))).stdout
    assert out.strip() == "False"


@pytest.mark.parametrize("group", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("window", [None, 100])
def test_prefill_rows_equal_their_decode(window, group):
    """Invariant 8 on the tiles: rows at chunk and slab edges, with and without a window
    (rows of one tile pair see different first keys). A decode's scores come out of S^T
    tiles of 4 columns by permutes for groups up to 4 (the last of a pair of rows alone
    for 1 and 3) and by gathers out of 16 columns for 8 (amx_walk.cpp key_scores)."""
    prefill = paged_case(context_lens=[530, 0], query_len=530, q_heads=2 * group, kv_heads=2, head_dim=64,
                         page_size=16, window=window, dtype="bfloat16", seed=8)
    with tile_path(True):
        out = prefill.run(impl.paged_attention)
        for l in [0, 1, 31, 32, 255, 256, 257, 511, 512, 529]:
            assert bits(prefill.decode_row(l).run(impl.paged_attention)) == bits(out[:, :, l:l + 1]), f"row {l}"


def test_flushed_sums_stay_equal():
    """Every score 0, so each visible key weighs exactly 1; V alternates 2^-125 and
    -(2^-125)(1 - 2^-7), so a row's weighted sum is a multiple of 2^-132: subnormal,
    which the tiles flush to zero. A row of a prefill also runs the slabs after its own
    (zero weights) and still equals its decode, at every position."""
    case = paged_case(context_lens=[100], query_len=100, q_heads=2, kv_heads=1, head_dim=64, page_size=16,
                      dtype="bfloat16", seed=4)
    vp = np.array(case.value_pages.astype(mx.float32))
    table = np.array(case.block_table)[0]
    for j in range(100):
        vp[table[j // 16], :, j % 16] = 2.0 ** -125 if j % 2 == 0 else -(2.0 ** -125) * (1 - 2.0 ** -7)
    case = case.with_(key_pages=mx.zeros_like(case.key_pages), value_pages=mx.array(vp).astype(mx.bfloat16))
    with tile_path(True):
        out = case.run(impl.paged_attention)
        odd = to_numpy(out).astype(np.float32)[0, :, 1::2]
        assert not odd.any(), "odd rows sum to a subnormal multiple of 2^-132 and come out zero"
        for l in range(100):
            assert bits(case.decode_row(l).run(impl.paged_attention)) == bits(out[:, :, l:l + 1]), f"row {l}"


def test_schedules_agree_on_tiles():
    """L = 8 (decode schedule: 16 rows a head, one row tile, keys read in place) against
    L = 9 (prefill schedule: 18 rows, two row tiles, keys packed)."""
    prefill = paged_case(context_lens=[CHUNK + 9, 40], query_len=9, q_heads=2, kv_heads=1, head_dim=64,
                         page_size=16, dtype="bfloat16", seed=31)
    decode = prefill.with_(query=prefill.query[:, :, 1:])
    with tile_path(True):
        assert bits(decode.run(impl.paged_attention)) == bits(prefill.run(impl.paged_attention)[:, :, 1:])


@pytest.mark.parametrize("L", [1, 40])
def test_thread_and_batch_invariance(L):
    case = paged_case(context_lens=[600, 57, 0], query_len=L, q_heads=8, kv_heads=2, head_dim=64, page_size=16,
                      dtype="bfloat16", seed=6)
    alone = case.with_(query=case.query[:1], block_table=case.block_table[:1], context_lens=case.context_lens[:1])
    before = impl.num_threads()
    outs = set()
    try:
        with tile_path(True):
            for n in (1, 2, 3):
                impl.set_num_threads(n)
                outs.add(bits(case.run(impl.paged_attention)))
            first = bits(alone.run(impl.paged_attention))
            assert first == bits(case.run(impl.paged_attention)[:1]), "row 0 alone differs from row 0 in the batch"
    finally:
        impl.set_num_threads(before)
    assert len(outs) == 1, f"{len(outs)} different outputs over 1, 2, 3 threads"


@pytest.mark.parametrize("name", ["decode-keys-in-place", "prefill-window-pages-of-5", "decode-pages-of-1"])
def test_unused_slots_change_nothing(name):
    """Invariant 9 on the tiles: NaN against zeros in tail slots and free pages. A decode
    reads whole 16-key blocks of a page in place, tail slots included: their scores
    must never reach a weight."""
    with tile_path(True):
        poisoned = layout_case(name).run(impl.paged_attention)
        clean = layout_case(name, fill=0.0).run(impl.paged_attention)
    assert bits(poisoned) == bits(clean)
