"""Merging two partial attention states in float64 NumPy (REFERENCE.md 1b, `merge_states`).

A state is what attention over a subset of the keys gives: the normalized output `o`
and its log-sum-exp `lse` (natural log). Over the union of two disjoint key sets

    lse = logaddexp(lse_a, lse_b),    o = e^(lse_a - lse) o_a + e^(lse_b - lse) o_b.

An empty state (lse = -inf, no key seen) has weight exactly 0 and its `o` is never read
(it may be anything, NaN included); two empty states give (0, -inf), never the NaN of
-inf - -inf. No MLX here and nothing shared with impl/merge.py or the other oracles.
"""

from __future__ import annotations

import numpy as np


def _f64(x) -> np.ndarray:
    """float64 copy of NumPy data, a sequence or an mx.array of any float dtype (through
    `.tolist()`, exact; no MLX import)."""
    if isinstance(x, np.ndarray) or not hasattr(x, "tolist"):
        return np.asarray(x, dtype=np.float64)
    return np.asarray(x.tolist(), dtype=np.float64)


def merge_states64(o_a, lse_a, o_b, lse_b) -> tuple[np.ndarray, np.ndarray]:
    """o `[..., Dv]`, lse `[...]` (array-likes, any float dtype) -> float64 (o, lse)."""
    o_a, lse_a, o_b, lse_b = (_f64(x) for x in (o_a, lse_a, o_b, lse_b))
    lse = np.logaddexp(lse_a, lse_b)
    both_empty = np.isneginf(lse)
    shift = np.where(both_empty, 0.0, lse)  # keeps -inf - -inf out of the exponent

    def part(o, lse_x):
        weight = np.exp(lse_x - shift)[..., None]  # 0 exactly for an empty state
        return np.where(np.isneginf(lse_x)[..., None], 0.0, weight * o)  # an empty state's o is never read

    return part(o_a, lse_a) + part(o_b, lse_b), lse
