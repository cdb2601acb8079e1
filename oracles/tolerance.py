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

## Quantized K/V pages (kv_dtype: fp8 e4m3fn / e5m2, int8 with scales)

The kernel's job is exact attention over the dequantized values `decode(code) * scale`
(contract/kv_format.py), so the rule above applies unchanged with the dequantized K/V in
place of the pages: `ref` is the float64 oracle over them, max|V| and max||k|| (Lambda
below) are the dequantized values' (oracles/compare.py; NaN / inf codes of unwritten
slots left out like any non-finite value), and SDPA (oracle c) runs in float32 on its
own decode of them with the query widened, its output rounded once to T. The rounding
of the K/V to 8 bits is not the kernel's error and is not allowed for here: it is
reported apart (`oracles.quantization_error`, against the unquantized K/V, per format).

What this cannot see: one-ulp differences (a reciprocal multiply instead of a divide).
Those are caught by the bitwise invariants (batch, thread, prefill == decode), not here.
A wrong key, page, head, mask or window moves the output by O(max|V| / context), orders
of magnitude above the allowance for the test shapes used here.

## Calls SDPA cannot express (contract v2)

MLX SDPA has no soft-cap, and in float16 / bfloat16 it takes sinks and an additive
(ALiBi) mask only in the query's dtype (oracles/sdpa.py raises `NotApplicable` unless
that rounding is exact). Where it cannot express the output, there is no e_sdpa, and
`SDPA_RATIO * e_sdpa` is replaced by an a-priori bound for a kernel that accumulates
in float32 as the contract says (scores, cap, bias, softmax in float32 from the
T-valued inputs, which the reference sees identically):

    E_na = expm1(2 * delta) * max|V|  +  2 * u_T * max|V|

    delta = min((Dk + 1) * u_32 * Lambda, 2 * c)  +  u_32 * (7 * Lambda_c + 8 * beta + n + 8)

* `Lambda = |scale| * max||q||_2 * max||k||_2` (rows of the query, finite key slots of the
  pool) bounds `|scale| * sum_i |q_i k_i|` for every score (Cauchy-Schwarz); the dot
  product of Dk terms in any order and the scale multiply err by at most
  `(Dk + 1) * u_32 * Lambda` (Higham's gamma_Dk). A soft-cap c does not amplify it
  (`d/ds c tanh(s/c) <= 1`) and leaves a score within [-c, c], so never more than 2c.
* `Lambda_c = min(Lambda, c)` (Lambda without a cap) bounds the capped score: the cap's
  division, tanh (a few ulps) and multiply, the max shift `s - m`, the bias add and
  exp's few ulps cost at most `7 * u_32 * Lambda_c + 8 * u_32 * beta + 8 * u_32` as a
  logit error; `beta = max|slope| * max(context_lens) + max|sigma|` bounds the ALiBi
  bias and the sink logit. `n = max(context_lens) + 1` (keys plus the sink): the
  float32 sums of the denominator and of each output component over at most n terms
  err relatively by gamma_n ~ n * u_32, the same as a logit error of n * u_32.
* With every logit within delta of exact, each softmax weight moves by a factor within
  e^(+-2 delta) (sink or not: the weights of the keys sum to at most 1), so the output,
  a mix of value rows, moves by at most `expm1(2 delta) * max|V|`.
* `2 * u_T * max|V|`: the weights rounded once to T before the product with V (a
  half-type kernel's P tile) and the normalization around it.
The other two terms of the rule stay. E_na is a worst case, not a measurement, so no
ratio multiplies it. Measured on standard-normal inputs (contexts 37 and 100): for
float32 the whole allowance is 4e-5 (Dk 16) to 3e-4 (Dk 128) relative to max|V|, where
the e_sdpa rule gives ~1e-6 (the float32 oracles' actual error: ~1e-7); for bfloat16
9e-3 against e_sdpa's 3e-3 to 6e-3. Both stay far below the O(max|V| / context) of a
wrong key and the O(1) of a cap, bias or sink applied in the wrong place. It grows
with Lambda: scores far beyond the cap (|s / c| ~ 1e4) make it loose, at most what a
logit error of 2c allows, though a kernel computes the saturated +-c exactly there
(tests/test_oracles_v2.py checks that case exactly); NaN or inf always fails it. A
kernel rounding its scores to T (MLX SDPA's CPU path does) is outside the contract's
float32 accumulation and may fail it.

## The log-sum-exp (return_lse)

The LSE `[B, Hq, L]` is float32 whatever T. It passes against the float64 LSE `ref` when

    max |lse - ref|  <=  delta  +  2 * u_T  +  LSE_SLACK * u_32 * max(1, max|ref|)      (finite ref)

and it is exactly -inf wherever ref is -inf (an empty slot); NaN or +inf anywhere, a
finite value where ref is -inf, -inf where ref is finite, or another shape is an
infinite error. lse is 1-Lipschitz in the largest logit error (`d lse / d s_j = w_j`,
sum w_j = 1), so the float32 logits and sum (delta above, the same bound) move it by
at most delta; `2 * u_T` is the output rule's weights rounded once to T seen from the
LSE: a half-type kernel that sums its rounded P tile for the denominator (so that the
output is an exact mix of its weights) has d off by a factor within 1 +- u_T, ln d by
about u_T (the built-in kernel's bfloat16 LSE errs by ~1e-3, float16's by ~3e-7,
measured; 2 u_T = 7.8e-3 for bfloat16); for
float32 the term is negligible. LSE_SLACK = 16 covers `m + log(d)` rounded in float32
(log's few ulps and the add, relative to |lse|, or to 1 near lse = 0). SDPA returns no
LSE, so this rule never measures it. (FlashAttention 2's +inf for an empty row, or a
base-2 LSE, are other conventions: adapters convert them before they get here.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

UNIT_ROUNDOFF = {mx.float32: 2.0 ** -24, mx.float16: 2.0 ** -11, mx.bfloat16: 2.0 ** -8}
SDPA_RATIO = 2.0
F32_SLACK = 16.0
LSE_SLACK = 16.0


def _f64(x) -> np.ndarray:
    if isinstance(x, mx.array):
        x = np.array(x.astype(mx.float32) if x.dtype != mx.float32 else x)
    return np.asarray(x, dtype=np.float64)


def max_abs_error(out, ref) -> float:
    """max |out - ref| in float64; any NaN or inf in `out`, or another shape, is an infinite error."""
    out, ref = _f64(out), np.asarray(ref, dtype=np.float64)
    if out.shape != ref.shape:
        return float("inf")
    diff = np.abs(out - ref)
    if diff.size == 0:
        return 0.0
    return float(diff.max()) if np.isfinite(diff).all() else float("inf")


def ref_scale(ref) -> float:
    """max |ref|: the rounding floor's scale and the relative error's denominator."""
    return float(np.abs(np.asarray(ref, dtype=np.float64)).max()) if np.size(ref) else 0.0


def allowed_error(dtype, ref, sdpa_error: float, value_scale: float) -> float:
    return (SDPA_RATIO * sdpa_error + UNIT_ROUNDOFF[dtype] * ref_scale(ref)
            + F32_SLACK * UNIT_ROUNDOFF[mx.float32] * value_scale)


def logit_error(head_dim: int, score_scale: float, bias_scale: float, keys: int,
                softcap: float | None = None) -> float:
    """delta: how far a float32 computation of each logit (and of the softmax's sums) may
    sit from the exact one, as a logit error. score_scale = Lambda, bias_scale = beta,
    keys = n (see the docstring above)."""
    u = UNIT_ROUNDOFF[mx.float32]
    score = (head_dim + 1) * u * score_scale
    capped = score_scale
    if softcap is not None:
        score, capped = min(score, 2.0 * softcap), min(score_scale, softcap)
    return score + u * (7.0 * capped + 8.0 * bias_scale + keys + 8.0)


def unmeasured_error(dtype, logit_err: float, value_scale: float) -> float:
    """E_na: what replaces SDPA_RATIO * e_sdpa where SDPA cannot express the call."""
    return math.expm1(2.0 * logit_err) * value_scale + 2.0 * UNIT_ROUNDOFF[dtype] * value_scale


def allowed_error_unmeasured(dtype, ref, logit_err: float, value_scale: float) -> float:
    """The output's allowance where SDPA is not applicable (E_na in place of SDPA_RATIO * e_sdpa)."""
    return (unmeasured_error(dtype, logit_err, value_scale) + UNIT_ROUNDOFF[dtype] * ref_scale(ref)
            + F32_SLACK * UNIT_ROUNDOFF[mx.float32] * value_scale)


def lse_scale(ref_lse) -> float:
    """max |ref| over the finite entries of a reference LSE (0 when none)."""
    ref = np.asarray(ref_lse, dtype=np.float64)
    finite = np.abs(ref[np.isfinite(ref)])
    return float(finite.max()) if finite.size else 0.0


def allowed_lse_error(ref_lse, logit_err: float, dtype=mx.float32) -> float:
    """The LSE rule's allowance; `dtype` is the query's (T), float32 when left out."""
    return (logit_err + 2.0 * UNIT_ROUNDOFF[dtype]
            + LSE_SLACK * UNIT_ROUNDOFF[mx.float32] * max(1.0, lse_scale(ref_lse)))


def lse_error(lse, ref_lse) -> float:
    """max |lse - ref| over the finite entries of ref; infinite for NaN (in either) or +inf anywhere,
    a finite lse where ref is -inf, -inf where ref is finite, or another shape."""
    lse, ref = _f64(lse), np.asarray(ref_lse, dtype=np.float64)
    if lse.shape != ref.shape:
        return float("inf")
    if lse.size == 0:
        return 0.0
    empty = np.isneginf(ref)
    if np.isnan(ref).any() or np.isnan(lse).any() or np.isposinf(lse).any() or not np.isneginf(lse[empty]).all():
        return float("inf")
    got, want = lse[~empty], ref[~empty]
    if not np.isfinite(got).all():
        return float("inf")
    return float(np.abs(got - want).max()) if got.size else 0.0


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

