"""The tolerance rule, stated once. Every numeric comparison in pagecheck uses it.

An output `out` of dtype T passes against the float64 oracle `ref` when

    max |out - ref|  <=  SDPA_RATIO * e_sdpa  +  u_T * max|ref|  +  F32_SLACK * u_32 * max|V|

* `e_sdpa` is MLX SDPA's own error against `ref` on the same inputs (oracle c). It
  measures what correct attention in T's arithmetic costs on *these* inputs: half
  types, large contexts and extreme logits all raise it. A different, equally stable
  summation order lands within a small factor of it; we allow SDPA_RATIO = 2.
* `u_T * max|ref|` is the floor for the one rounding of the result to T (u_T = 2^-24,
  2^-11, 2^-8 for float32, float16, bfloat16): every correct kernel pays it and SDPA
  may dodge it by luck on a given element, so the rule must not depend on that luck.
* `F32_SLACK * u_32 * max|V|` (F32_SLACK = 16, ~1e-6 relative to the values) covers
  float32 accumulation in another order and an exp accurate to a few ulps. Outputs are
  convex mixes of value rows, so max|V| (over the slots requests may read) bounds them.

What this cannot see: one-ulp differences (a reciprocal multiply instead of a divide).
Those are caught by the bitwise invariants (batch, thread, prefill == decode), not here.
A wrong key, page, head, mask or window moves the output by O(max|V| / context), orders
of magnitude above the allowance for the test shapes used here.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

UNIT_ROUNDOFF = {mx.float32: 2.0 ** -24, mx.float16: 2.0 ** -11, mx.bfloat16: 2.0 ** -8}
SDPA_RATIO = 2.0
F32_SLACK = 16.0


def max_abs_error(out, ref) -> float:
    """max |out - ref| in float64; any NaN or inf in `out` is an infinite error."""
    if isinstance(out, mx.array):
        out = np.array(out.astype(mx.float32) if out.dtype != mx.float32 else out)
    diff = np.abs(np.asarray(out, dtype=np.float64) - np.asarray(ref, dtype=np.float64))
    if diff.size == 0:
        return 0.0
    return float(diff.max()) if np.isfinite(diff).all() else float("inf")


def ref_scale(ref) -> float:
    """max |ref|: the rounding floor's scale and the relative error's denominator."""
    return float(np.abs(np.asarray(ref, dtype=np.float64)).max()) if np.size(ref) else 0.0


def allowed_error(dtype, ref, sdpa_error: float, value_scale: float) -> float:
    return (SDPA_RATIO * sdpa_error + UNIT_ROUNDOFF[dtype] * ref_scale(ref)
            + F32_SLACK * UNIT_ROUNDOFF[mx.float32] * value_scale)


@dataclass(frozen=True)
class Verdict:
    error: float
    allowed: float
    scale: float = 0.0  # max |ref|, when known: relative error = error / scale

    @property
    def relative(self) -> float:
        return self.error / self.scale if self.scale else (0.0 if self.error == 0 else float("inf"))

    @property
    def ok(self) -> bool:
        return self.error <= self.allowed

    def __str__(self) -> str:
        return f"max abs error {self.error:.3e} vs allowed {self.allowed:.3e}"

