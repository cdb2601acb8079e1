"""Bit-for-bit comparisons shared by the invariant tests (REFERENCE.md invariants 6-9)."""

from __future__ import annotations

import os

from fixtures import Bits, bits


def result_bits(result) -> tuple[Bits, ...]:
    """The raw bytes of a call's result: the output, or each array of (output, lse)."""
    return tuple(bits(x) for x in (result if isinstance(result, tuple) else (result,)))


def bits_over_worker_counts(case, attention, counts=(1, 2, 3)) -> set:
    """The distinct result_bits of `case` run with each worker count and with every core
    (invariant 7: a set of one); the implementation is left on every core."""
    every = os.cpu_count() or 1
    seen = set()
    try:
        for n in (*counts, every):
            attention.set_num_threads(n)
            seen.add(result_bits(case.run(attention)))
    finally:
        attention.set_num_threads(every)
    return seen
