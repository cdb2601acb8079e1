"""The bfloat16 score loop on AVX512-BF16's pair dot product (impl/csrc/pair_dots.h): a
choice of speed only, so every call must give the FMA loop's bits with it on and off.
Skipped where the build has no AVX512-BF16; the tile path is switched off throughout
(the pair loop is part of the FMA path).

| what must hold                                                  | test                                          |
|-----------------------------------------------------------------|-----------------------------------------------|
| same bits on and off: GQA groups of 1-4 rows, head dims 32-128, | test_same_bits_either_way                     |
| pages of 1-128, windows, a negative scale, soft-cap, sinks;     |                                               |
| 16 and 48 rows a head (blocks put in pair order once; decode,   |                                               |
| prefill), 64 (transposed)                                       |                                               |
| ... and every score's last bit (512 rows whose lse show it)     | test_every_score_keeps_its_last_bit           |
| K blocks with subnormal elements (flushed by vdpbf16ps) take    | test_subnormal_keys_take_the_fma_loop         |
| the FMA loop, read in place or put in pair order, whatever      |                                               |
| their signs                                                     |                                               |
| ... also one such row in a block of zeros (the guard's second   | test_one_tiny_key_row_late_in_a_block_is_found|
| look, at every row)                                             |                                               |
| exact zeros are not tiny: their blocks stay on the pair loop    | test_zero_keys_stay_on_the_pair_loop          |
| query rows whose products underflow take the FMA loop           | test_tiny_queries_take_the_fma_loop           |
| it applies below 64 rows a head (where blocks are transposed),  | test_applies_below_the_transposed_blocks      |
| to bfloat16 head dims that are multiples of 32, while on        |                                               |
| the default: on where the build has it and the CPU is AMD's,    | test_default_follows_the_cpu_and_the_variable |
| $PAGECHECK_PAIR_DOTS overrides                                  |                                               |
| the switch takes a bool only                                    | test_switch_takes_only_a_bool                 |

The two guard tests use a scale near float32's largest, so that scores of 2^-130 to
2^-140 (the flush's range) become logits that move the output's bits.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import numpy as np
import pagecheck_kernels
import pytest

import impl
from fixtures import paged_case
from tests.bitwise import result_bits
from tests.speed_switches import amd_cpu, enabled_in_a_fresh_process
from tests.tile_path import tile_path

pytestmark = [pytest.mark.correctness, pytest.mark.builtin_only("the built-in kernel's bfloat16 score loop")]

NO_PAIRS = "this build has no AVX512-BF16 (impl/csrc/pair_dots.h)"

# (context_lens, query_len, q_heads, kv_heads, head_dim, page_size, window): rows per KV
# head 1-4 (the loop's NR), 16 (blocks put in pair order once for four row groups: a
# decode's longer queries), 48 (a short prefill's query block), 64 (blocks transposed:
# the pair loop stays off), head dims
# that are and are not multiples of 32 (48: the FMA loop alone), pages smaller than a
# block, windows, several chunks.
LAYOUTS = {
    "group-4-four-rows-d128-pages-16": ([300, 37], 4, 8, 2, 128, 16, None),
    "group-2-eight-rows-d64-pages-128": ([600, 9], 8, 4, 2, 64, 128, None),
    "group-8-eight-rows-transposed": ([90], 8, 8, 1, 32, 16, None),
    "group-4-twelve-rows-prefill": ([40, 300], 12, 8, 2, 128, 16, None),
    "group-4-d128-pages-16": ([37, 300], 1, 8, 2, 128, 16, None),
    "group-1-d64-pages-1": ([70, 3], 1, 2, 2, 64, 1, None),
    "group-2-two-rows-pages-128": ([129, 5, 600], 2, 2, 2, 128, 128, None),
    "group-3-d96-window": ([520, 17], 1, 6, 2, 96, 16, 100),
    "group-1-four-rows-d32": ([700], 4, 2, 2, 32, 32, None),
    "group-4-d48-fma-only": ([90], 1, 4, 1, 48, 16, None),
}


@contextmanager
def pair_dots(on: bool):
    """bfloat16 calls evaluated inside score with the pair loop (on) or FMAs (off), on the
    FMA path (tiles off); the settings before are restored."""
    if not impl.runtime.pair_dots_supported():
        pytest.skip(NO_PAIRS)
    before = impl.runtime.pair_dots_enabled()
    impl.runtime.set_pair_dots(on)
    try:
        with tile_path(False):
            yield
    finally:
        impl.runtime.set_pair_dots(before)


def bits_both_ways(case):
    """result_bits with the pair loop on and off, the float32 lse included: a score's last
    bit seldom reaches a bfloat16 output, but it moves its row's lse."""
    return refusals_and_bits(case)[1:]


def refusals_and_bits(case):
    """(K blocks the pair loop refused while on, bits on, bits off): bits_both_ways with
    the refusals counted (pagecheck_kernels.pair_dots_refusals, process-wide)."""
    case = case.with_(return_lse=True)
    outs = []
    for on in (True, False):
        with pair_dots(on):
            before = pagecheck_kernels.pair_dots_refusals()
            outs.append(result_bits(case.run(impl.paged_attention)))
            if on:
                refused = pagecheck_kernels.pair_dots_refusals() - before
    return (refused, *outs)


def layout_case(name, seed=3, **changes):
    lens, L, hq, hkv, d, ps, window = LAYOUTS[name]
    return paged_case(**{**dict(context_lens=lens, query_len=L, q_heads=hq, kv_heads=hkv, head_dim=d, page_size=ps,
                                window=window, dtype="bfloat16", seed=seed), **changes})


def with_arrays(case, query=None, keys=None):
    """`case` with its query and/or every K element replaced (float32 numpy, cast to bf16)."""
    changes = {}
    if query is not None:
        changes["query"] = mx.array(query).astype(mx.bfloat16)
    if keys is not None:
        changes["key_pages"] = mx.array(keys).astype(mx.bfloat16)
    return case.with_(**changes)


def magnitudes(rng, shape, exponent):
    """Random signs times [1, 2) * 2^exponent: every element the same binade."""
    return (rng.choice([-1.0, 1.0], shape) * (1.0 + rng.random(shape)) * 2.0 ** exponent).astype(np.float32)


@pytest.mark.parametrize("options", ["plain", "negative-scale", "softcap", "sinks"])
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_same_bits_either_way(name, options):
    case = layout_case(name)
    hq = case.query.shape[1]
    case = case.with_(**{"plain": {}, "negative-scale": {"scale": -0.3}, "softcap": {"softcap": 5.0},
                         "sinks": {"sinks": mx.array(np.linspace(-1, 1, hq, dtype=np.float32))}}[options])
    on, off = bits_both_ways(case)
    assert on == off


@pytest.mark.parametrize("scale", [None, 8.0])
def test_every_score_keeps_its_last_bit(scale):
    """512 rows of 40 keys (B 16, Hq 32, Hkv 8, D 128). A score's last bit seldom reaches a
    bfloat16 output, nor the lse of a long row; here each row's lse rests on few keys, and
    the pair loop with its two products swapped (other bits in 2% of scores) changed 4-11
    of the 512 lse and 0-4 outputs, on each of three seeds."""
    case = paged_case(context_lens=[40] * 16, query_len=1, q_heads=32, kv_heads=8, head_dim=128, page_size=16,
                      dtype="bfloat16", seed=21, scale=scale)
    on, off = bits_both_ways(case)
    assert on == off


GUARDED = ["group-4-d128-pages-16", "group-4-four-rows-d128-pages-16"]  # blocks in place, blocks in pair order


@pytest.mark.parametrize("signs", ["mixed", "negative"])
@pytest.mark.parametrize("name", GUARDED)
def test_subnormal_keys_take_the_fma_loop(name, signs):
    """K elements below float32's normal range (bfloat16 subnormals): vdpbf16ps reads them
    as zero. KV head 0 holds only such keys (scores of about 2^-127, logits of about 1 at
    this scale), KV head 1 normal ones (its blocks take the pair loop). All negative: the
    guard's first look must drop the sign bit, or every such element looks large."""
    case = layout_case(name, seed=11)
    rng = np.random.default_rng(11)
    keys = np.array(case.key_pages.astype(mx.float32))
    tiny = magnitudes(rng, keys[:, 0].shape, -131)
    keys[:, 0] = -np.abs(tiny) if signs == "negative" else tiny
    case = with_arrays(case, keys=keys).with_(scale=2.0 ** 126)
    refused, on, off = refusals_and_bits(case)
    assert on == off and refused > 0


@pytest.mark.parametrize("name", GUARDED)
def test_one_tiny_key_row_late_in_a_block_is_found(name):
    """KV head 0: every K element zero but one row of each page (key 13 of its 16), which
    holds subnormals. The zeros fail the guard's first look (two ops a vector, zeros
    counted as tiny), so it looks again at every row of the block, zeros left out, and must
    find row 13; the block is refused and the bits stay the FMA loop's."""
    case = layout_case(name, seed=13)
    rng = np.random.default_rng(13)
    keys = np.array(case.key_pages.astype(mx.float32))
    keys[:, 0] = 0.0
    keys[:, 0, 13] = magnitudes(rng, keys[:, 0, 13].shape, -131)
    case = with_arrays(case, keys=keys).with_(scale=2.0 ** 126)
    refused, on, off = refusals_and_bits(case)
    assert on == off and refused > 0


@pytest.mark.parametrize("name", GUARDED)
def test_zero_keys_stay_on_the_pair_loop(name):
    """Exact zeros (+0 and -0) are not tiny: a block full of them, or of normal elements
    beside them, is scored on the pair loop (no refusal), with the FMA loop's bits. Half
    of KV head 0's pages are zero, the other half normal with every third element +-0."""
    case = layout_case(name, seed=14)
    keys = np.array(case.key_pages.astype(mx.float32))
    keys[::2, 0] = 0.0
    keys[1::2, 0, :, ::3] = np.where(np.arange(keys.shape[-1])[::3] % 2 == 0, 0.0, -0.0)
    case = with_arrays(case, keys=keys)
    refused, on, off = refusals_and_bits(case)
    assert on == off and refused == 0


@pytest.mark.parametrize("name", GUARDED)
def test_tiny_queries_take_the_fma_loop(name):
    """Query elements of 2^-100 against K elements of 2^-40, both normal bfloat16s: their
    products (2^-140) are subnormal, which vdpbf16ps flushes to zero. One query head of
    each group is tiny, the others normal (they take the pair loop)."""
    case = layout_case(name, seed=12)
    rng = np.random.default_rng(12)
    query = np.array(case.query.astype(mx.float32))
    query[:, ::4] = magnitudes(rng, query[:, ::4].shape, -100)
    keys = magnitudes(rng, case.key_pages.shape, -40)
    case = with_arrays(case, query=query, keys=keys).with_(scale=2.0 ** 126)
    on, off = bits_both_ways(case)
    assert on == off


def test_applies_below_the_transposed_blocks():
    """Rows per KV head: 1-4 score blocks read in place, 5-63 blocks put in pair order once
    (a decode's longer queries; the FMA loop widened them instead, ~20% slower at 16
    rows), 64 and more transposed blocks (the prefill's loop, no fold to halve)."""
    pairs = pagecheck_kernels.pair_dots_apply
    with pair_dots(True):
        assert [pairs(rows, 128) for rows in (1, 4, 5, 16, 32, 63)] == [True] * 6
        assert [pairs(64, 128), pairs(256, 128)] == [False, False]
        assert [pairs(16, 96), pairs(16, 32), pairs(16, 48), pairs(4, 80)] == [True, True, False, False]
    with pair_dots(False):
        assert [pairs(rows, 128) for rows in (1, 16, 63)] == [False] * 3


def _enabled_in_a_fresh_process(value):
    return enabled_in_a_fresh_process("pair_dots_enabled", "PAGECHECK_PAIR_DOTS", value)


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="no /proc/cpuinfo to tell the CPU's vendor")
def test_default_follows_the_cpu_and_the_variable():
    supported = impl.runtime.pair_dots_supported()
    assert _enabled_in_a_fresh_process(None) == (supported and amd_cpu())
    assert _enabled_in_a_fresh_process("0") is False
    assert _enabled_in_a_fresh_process("1") == supported


@pytest.mark.parametrize("bad", [1, 0, "on", None])
def test_switch_takes_only_a_bool(bad):
    before = impl.runtime.pair_dots_enabled()
    with pytest.raises(ValueError, match="True or False"):
        impl.runtime.set_pair_dots(bad)
    assert impl.runtime.pair_dots_enabled() == before


def test_on_where_unsupported_is_an_error():
    if impl.runtime.pair_dots_supported():
        pytest.skip("this build has AVX512-BF16")
    with pytest.raises(ValueError, match="AVX512-BF16"):
        impl.runtime.set_pair_dots(True)
    assert impl.runtime.pair_dots_enabled() is False
