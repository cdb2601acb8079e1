"""Choosing the bfloat16 arithmetic for a block of a test: the AMX tiles or the
float32 fused multiply-adds (impl/csrc/amx.h)."""

from __future__ import annotations

from contextlib import contextmanager

import pytest

import impl

NO_TILES = "no AMX tile path here (CPU without AMX-BF16, Linux without tile state, or a plain build)"


@contextmanager
def tile_path(on: bool):
    """bfloat16 calls evaluated inside run on the tiles (on) or with FMAs (off); the
    setting before is restored. On skips the test where the tiles are not supported."""
    if not impl.amx_supported():
        if on:
            pytest.skip(NO_TILES)
        yield
        return
    before = impl.amx_enabled()
    impl.set_amx(on)
    try:
        yield
    finally:
        impl.set_amx(before)


def same_bits_either_way(case):
    """`case` (bfloat16) run with the tiles switched on and off: a call the tiles leave to
    the FMA path gives the same bits both ways (asserted). Returns the output."""
    from tests.bitwise import result_bits

    with tile_path(True):
        on = case.run(impl.paged_attention)
    with tile_path(False):
        off = case.run(impl.paged_attention)
    assert result_bits(on) == result_bits(off)
    return on
