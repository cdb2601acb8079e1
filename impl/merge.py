"""`merge_states`: two attention states over disjoint key sets -> the state over both.

| symbol         | meaning                                                   | dtype / shape        |
|----------------|-----------------------------------------------------------|----------------------|
| `o_a`, `o_b`   | normalized outputs over key sets A and B                  | f32/f16/bf16 `[..., Dv]` (same) |
| `lse_a`, `lse_b` | their log-sum-exps (natural log; `-inf`: no key)        | float32 `[...]`      |
| returns        | `(o, lse)`: `lse = logaddexp(lse_a, lse_b)`, `o = e^(lse_a - lse) o_a + e^(lse_b - lse) o_b` | o_a's dtype, float32 |

Cascade attention: a shared prefix attended once and each suffix separately, merged,
equals one call over prefix + suffix. Two empty states give `(0, -inf)`, never NaN
(-inf - -inf is NaN, FlashInfer #4051): the weights are taken against the larger lse
and an empty pair is selected to zero. A sink belongs to exactly one of the two calls.
"""

from __future__ import annotations

import mlx.core as mx

from .errors import ContractViolation
from .validation import FLOAT_DTYPES, _dtype_name, _require_array


def merge_states(o_a: mx.array, lse_a: mx.array, o_b: mx.array, lse_b: mx.array) -> tuple[mx.array, mx.array]:
    for name, x in (("o_a", o_a), ("lse_a", lse_a), ("o_b", o_b), ("lse_b", lse_b)):
        _require_array(name, x)
    if o_a.dtype not in FLOAT_DTYPES or o_b.dtype != o_a.dtype:
        raise ContractViolation("merge", f"o_a and o_b must share a float dtype (float32, float16, bfloat16); got "
                                         f"{_dtype_name(o_a.dtype)} and {_dtype_name(o_b.dtype)}")
    for name, x in (("lse_a", lse_a), ("lse_b", lse_b)):
        if x.dtype != mx.float32:
            raise ContractViolation("merge", f"{name} must be float32, got {_dtype_name(x.dtype)}")
    if tuple(o_a.shape) != tuple(o_b.shape) or o_a.ndim < 1:
        raise ContractViolation("merge", f"o_a shape {tuple(o_a.shape)} differs from o_b shape {tuple(o_b.shape)}")
    for name, x in (("lse_a", lse_a), ("lse_b", lse_b)):
        if tuple(x.shape) != tuple(o_a.shape[:-1]):
            raise ContractViolation("merge", f"{name} shape {tuple(x.shape)} is not the outputs' shape without "
                                             f"the head dim {tuple(o_a.shape[:-1])}")
    top = mx.maximum(lse_a, lse_b)
    live = top > -mx.inf
    anchor = mx.where(live, top, 0.0)  # an empty pair subtracts 0, never -inf
    wa, wb = mx.exp(lse_a - anchor), mx.exp(lse_b - anchor)  # e^-inf = 0 for an empty side
    total = wa + wb
    lse = mx.where(live, anchor + mx.log(total), -mx.inf)
    inv = mx.where(live, 1.0 / mx.where(live, total, 1.0), 0.0)
    o = _weighted(wa * inv, o_a) + _weighted(wb * inv, o_b)
    return o.astype(o_a.dtype), lse


def _weighted(weight: mx.array, o: mx.array) -> mx.array:
    """weight * o, and exactly 0 where the weight is 0: a state that adds nothing (an empty
    one, whatever its output holds, or one e^-104 below the other) adds no NaN either."""
    w = weight[..., None]
    return mx.where(w > 0, w * o.astype(mx.float32), 0.0)
