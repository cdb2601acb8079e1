"""A prefill's transposed K blocks scored two at a time or one (impl/csrc/transposed.h
scores_transposed, transposed_walk.h score_transposed): a choice of speed only, so every
prefill must give the same bits with the pairs on and off, and the switch must really
choose the walk (pagecheck_kernels.transposed_pairs_scored counts the pairs). The tile
path is switched off throughout (bfloat16 prefills take the transposed walk only on the
FMA path).

| what must hold                                                  | test                                          |
|-----------------------------------------------------------------|-----------------------------------------------|
| same bits and lse on and off: float32, bfloat16, float16; GQA   | test_same_bits_either_way                     |
| groups of 1-4, head dims 64-128, pages of 1-128, a chunk's odd  |                                               |
| last block, windows, a prefix in the cache, a negative scale,   |                                               |
| soft-cap; fp8 and int8 pages with their scales                  |                                               |
| on scores pairs, off none                                       | test_same_bits_either_way (the counter)       |
| the default: off on AMD's Zen 4 and older (family 0x19 and      | test_default_follows_the_cpu_and_the_variable |
| below), on elsewhere (Intel, Zen 5); $PAGECHECK_TRANSPOSED_PAIRS | test_pairs_pay_where_loads_bound_a_block      |
| (0 or 1) overrides                                              |                                               |
| the switch takes a bool only, and changes nothing when refused  | test_switch_takes_only_a_bool                 |
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import pagecheck_kernels
import pytest

import impl
from fixtures import paged_case
from fixtures.quantized import quantized
from tests.bitwise import result_bits
from tests.speed_switches import amd_cpu, cpu_family, enabled_in_a_fresh_process
from tests.tile_path import tile_path

pytestmark = [pytest.mark.correctness, pytest.mark.builtin_only("the built-in kernel's transposed prefill walk")]

NO_WALK = "this build has no transposed prefill walk (no AVX-512)"

# (context_lens, query_len, q_heads, kv_heads, head_dim, page_size, dtype, window): every
# case has at least 64 query rows a KV head (kTransposeRows), so its chunks take the walk;
# contexts that leave a chunk an odd number of 16-key blocks (its last block alone).
LAYOUTS = {
    "f32-group-4-d128-pages-16": ([150], 150, 8, 2, 128, 16, "float32", None),
    "f32-group-1-d64-prefix-pages-128": ([300, 237], 90, 2, 2, 64, 128, "float32", None),
    "f32-group-2-d64-window-pages-1": ([200], 70, 4, 2, 64, 1, "float32", 37),
    "bf16-group-2-d96-pages-16": ([181], 181, 4, 2, 96, 16, "bfloat16", None),
    "f16-group-4-d64-pages-32": ([97, 150], 60, 8, 2, 64, 32, "float16", None),
}
OPTIONS = {"plain": {}, "negative-scale": {"scale": -0.3}, "softcap": {"softcap": 5.0}}


@contextmanager
def transposed_pairs(on: bool):
    """Prefills evaluated inside score their transposed K blocks in pairs (on) or one at a
    time (off), tiles off; the settings before are restored."""
    if not _built():
        pytest.skip(NO_WALK)
    before = impl.runtime.transposed_pairs_enabled()
    impl.runtime.set_transposed_pairs(on)
    try:
        with tile_path(False):
            yield
    finally:
        impl.runtime.set_transposed_pairs(before)


def _built() -> bool:
    """Whether this build has the transposed walk: switching the pairs on is refused
    without it."""
    before = impl.runtime.transposed_pairs_enabled()
    try:
        impl.runtime.set_transposed_pairs(True)
    except ValueError:
        return False
    impl.runtime.set_transposed_pairs(before)
    return True


def pairs_and_bits(case):
    """(pairs scored on, pairs scored off, bits on, bits off), the float32 lse included:
    a score's last bit seldom reaches a half-precision output, but it moves its row's lse."""
    case = case.with_(return_lse=True)
    counts, outs = [], []
    for on in (True, False):
        with transposed_pairs(on):
            before = pagecheck_kernels.transposed_pairs_scored()
            outs.append(result_bits(case.run(impl.paged_attention)))
            counts.append(pagecheck_kernels.transposed_pairs_scored() - before)
    return (*counts, *outs)


def layout_case(name, seed=5):
    lens, L, hq, hkv, d, ps, dtype, window = LAYOUTS[name]
    return paged_case(context_lens=lens, query_len=L, q_heads=hq, kv_heads=hkv, head_dim=d, page_size=ps,
                      window=window, dtype=dtype, seed=seed)


@pytest.mark.parametrize("options", sorted(OPTIONS))
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_same_bits_either_way(name, options):
    case = layout_case(name).with_(**OPTIONS[options])
    on_pairs, off_pairs, on, off = pairs_and_bits(case)
    assert on_pairs > 0 and off_pairs == 0, (on_pairs, off_pairs)
    assert on == off


@pytest.mark.parametrize("kv_dtype,k,v", [("float8_e4m3fn", "tensor", "tensor"), ("float8_e5m2", "head", "token"),
                                          ("int8", "token", "token")])
def test_same_bits_either_way_quantized(kv_dtype, k, v):
    """Quantized pages: K's scale multiplies the scores after either walk (scale_scores)."""
    case = quantized(layout_case("f32-group-4-d128-pages-16"), kv_dtype, k=k, v=v)
    on_pairs, off_pairs, on, off = pairs_and_bits(case)
    assert on_pairs > 0 and off_pairs == 0, (on_pairs, off_pairs)
    assert on == off


def _enabled_in_a_fresh_process(value):
    return enabled_in_a_fresh_process("transposed_pairs_enabled", "PAGECHECK_TRANSPOSED_PAIRS", value)


def _pairs_pay(amd: bool, family: int) -> bool:
    """One block at a time only where the FMAs, not the loads, bound it: AMD's Zen 4 (its
    512-bit FMAs in two halves), family 0x19; Zen 3 and older have no walk to choose."""
    return not amd or family >= 0x1A


# (AMD's?, cpuid display family): Intel's cores (6) and its newer family 19, AMD's Zen 2
# (0x17), Zen 3 / Zen 4 (0x19), Zen 5 (0x1A) and a later family
CPUS = [(False, 6), (False, 19), (True, 0x17), (True, 0x19), (True, 0x1A), (True, 0x1B)]


@pytest.mark.parametrize("amd, family", CPUS)
def test_pairs_pay_where_loads_bound_a_block(amd, family):
    assert pagecheck_kernels.transposed_pairs_pay(amd, family) is _pairs_pay(amd, family)


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="no /proc/cpuinfo to tell the CPU's vendor and family")
def test_default_follows_the_cpu_and_the_variable():
    built = _built()
    assert _enabled_in_a_fresh_process(None) == (built and _pairs_pay(amd_cpu(), cpu_family()))
    assert _enabled_in_a_fresh_process("0") is False
    assert _enabled_in_a_fresh_process("1") == built


@pytest.mark.parametrize("bad", [1, 0, "on", None])
def test_switch_takes_only_a_bool(bad):
    before = impl.runtime.transposed_pairs_enabled()
    with pytest.raises(ValueError, match="True or False"):
        impl.runtime.set_transposed_pairs(bad)
    assert impl.runtime.transposed_pairs_enabled() == before
