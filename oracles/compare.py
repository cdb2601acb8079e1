"""One output against all four oracles under the tolerance rule.

`float64` is the reference. Each MLX oracle must itself pass the rule against it (so a
broken oracle is reported as such), and the output must be within the allowance plus
that oracle's own error of each MLX oracle (triangle inequality).

With `return_lse=True` the output under test is the pair `(out, lse)`, and the LSE is
judged the same way under the LSE rule (oracles/tolerance.py) against each oracle that
returns one. An oracle that cannot express the call raises `oracles.NotApplicable`: it
is left out of `oracle_self` / `against_oracle` and its reason kept in
`Comparison.not_applicable` (`"sdpa"`: the whole call; `"sdpa lse"`: only the LSE, its
output still judged and its error still the allowance's e_sdpa). Where SDPA cannot give
the output, the allowance replaces its error by the a-priori bound E_na.

With quantized pages (a `kv_dtype`) the magnitudes the allowance reads, max|V| and
max||k||, are those of the dequantized values (`decode(code) * scale`, decoded by the
float64 oracle's `numpy64.dequantize`), never of the codes; non-finite ones (NaN / inf
codes, NaN token scales of unwritten slots) are left out as non-finite values are
without a format.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from contract import ScorePipeline

from . import MLX_ORACLES, NotApplicable, float64, numpy64
from .tolerance import (Verdict, allowed_error, allowed_error_unmeasured, allowed_lse_error, logit_error,
                        lse_error, lse_scale, max_abs_error, ref_scale)


@dataclass(frozen=True)
class Comparison:
    against_float64: Verdict
    oracle_self: dict  # name -> Verdict of that oracle against float64
    against_oracle: dict  # name -> Verdict of the output against that oracle
    lse_against_float64: Verdict | None = None  # with return_lse: the LSE against the float64 LSE
    lse_oracle_self: dict = field(default_factory=dict)  # name -> Verdict of that oracle's LSE
    lse_against_oracle: dict = field(default_factory=dict)  # name -> Verdict of the LSE against that oracle's
    not_applicable: dict = field(default_factory=dict)  # name -> why that oracle (or "name lse") is left out

    def failures(self) -> list[str]:
        bad = [f"oracle {n} itself: {v}" for n, v in self.oracle_self.items() if not v.ok]
        bad += [f"oracle {n} lse itself: {v}" for n, v in self.lse_oracle_self.items() if not v.ok]
        if not self.against_float64.ok:
            bad.append(f"vs float64: {self.against_float64}")
        if self.lse_against_float64 is not None and not self.lse_against_float64.ok:
            bad.append(f"lse vs float64: {self.lse_against_float64}")
        bad += [f"vs {n}: {v}" for n, v in self.against_oracle.items() if not v.ok]
        bad += [f"lse vs {n}: {v}" for n, v in self.lse_against_oracle.items() if not v.ok]
        return bad


def _values(pages, kv_dtype: str | None = None, scale=None) -> np.ndarray:
    """What a pool holds as float64: its elements, or with a kv_dtype its codes dequantized."""
    if kv_dtype is None:
        return np.array(pages.astype(mx.float32), dtype=np.float64)
    return numpy64.dequantize(np.array(pages), kv_dtype, scale)


def value_scale(value_pages, kv_dtype: str | None = None, v_scale=None) -> float:
    """max|V| over the finite values of the pool (1.0 when none); with a kv_dtype, of the
    dequantized values, `v_scale` the pool's scale (shapes as in contract/kv_format.py)."""
    v = _values(value_pages, kv_dtype, v_scale)
    finite = np.abs(v[np.isfinite(v)])
    return float(finite.max()) if finite.size else 1.0


def _max_row_norm(x, kv_dtype: str | None = None, scale=None) -> float:
    """Largest Euclidean norm of a finite row (last axis) of x (dequantized with a kv_dtype);
    0 when there is none."""
    rows = _values(x, kv_dtype, scale).reshape(-1, x.shape[-1]) if x.size else np.zeros((0, 1))
    rows = rows[np.isfinite(rows).all(axis=1)]
    return float(np.sqrt((rows * rows).sum(axis=1)).max()) if rows.size else 0.0


def _max_abs(x) -> float:
    if x is None:
        return 0.0
    v = np.abs(np.array(mx.array(x).astype(mx.float32), dtype=np.float64))
    v = v[np.isfinite(v)]
    return float(v.max()) if v.size else 0.0


def call_logit_error(args: tuple, kwargs: dict | None = None) -> float:
    """delta of the tolerance rule for one call: Lambda = |scale| max||q|| max||k|| (finite
    key slots of the pool, dequantized with a kv_dtype), beta = max|slope| max(context_lens)
    + max|sigma|, n = max context + 1."""
    pipeline = ScorePipeline.of(kwargs)
    query, key_pages, context_lens = args[0], args[1], args[4]
    head_dim = query.shape[-1]
    scale = abs(head_dim ** -0.5 if pipeline.scale is None else float(pipeline.scale))
    kv = pipeline.kv
    score_scale = scale * _max_row_norm(query) * _max_row_norm(key_pages, kv.dtype, kv.k_scale)
    longest = int(np.array(context_lens).max()) if context_lens.size else 0
    bias_scale = _max_abs(pipeline.alibi_slopes) * longest + _max_abs(pipeline.sinks)
    softcap = None if pipeline.softcap is None else float(pipeline.softcap)
    return logit_error(head_dim, score_scale, bias_scale, longest + 1, softcap)


def allowance(args: tuple, ref, sdpa_out, kwargs: dict | None = None):
    """The tolerance rule's allowance for one call (`args` positional, the value pool third)
    given the float64 answer and the SDPA oracle's output on it: a float. `sdpa_out` None
    (SDPA not applicable): E_na replaces SDPA's error. `ref` the pair (out, lse) of a
    return_lse call: the pair (output allowance, LSE allowance)."""
    ref_out, ref_lse = ref if isinstance(ref, tuple) else (ref, None)
    kv = ScorePipeline.of(kwargs).kv
    dtype, values = args[0].dtype, value_scale(args[2], kv.dtype, kv.v_scale)
    if sdpa_out is None:
        allowed = allowed_error_unmeasured(dtype, ref_out, call_logit_error(args, kwargs), values)
    else:
        allowed = allowed_error(dtype, ref_out, max_abs_error(sdpa_out, ref_out), values)
    if ref_lse is None:
        return allowed
    return allowed, allowed_lse_error(ref_lse, call_logit_error(args, kwargs), dtype)


def _sdpa_output(args: tuple, kwargs: dict):
    """The SDPA oracle's output (it never gives an LSE), evaluated; None where not applicable."""
    pipeline = ScorePipeline.of(kwargs)
    try:
        out = MLX_ORACLES["sdpa"](*args, **(pipeline.with_(return_lse=False).kwargs() if pipeline.return_lse
                                             else kwargs))
    except NotApplicable:
        return None
    mx.eval(out)
    return out


def reference(args: tuple, kwargs: dict):
    """The float64 oracle's answer on one call and the tolerance rule's allowance for it:
    (ref, allowed), or ((ref, ref_lse), (allowed, allowed_lse)) with return_lse."""
    ref = float64(*args, **kwargs)
    return ref, allowance(args, ref, _sdpa_output(args, kwargs), kwargs)


def _split(out, return_lse: bool, who: str):
    """(output, lse or None), checking the call's return structure."""
    if return_lse:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(f"{who}: with return_lse=True the call returns (out, lse), got {type(out).__name__}")
        return out
    if isinstance(out, tuple):
        raise TypeError(f"{who}: without return_lse the call returns out alone, got a tuple")
    return out, None


def _run_oracles(args: tuple, kwargs: dict):
    """name -> output, name -> lse (those returning one), name -> reason (those left out)."""
    pipeline = ScorePipeline.of(kwargs)
    outs, lses, skipped = {}, {}, {}
    for name, fn in MLX_ORACLES.items():
        try:
            outs[name], lses[name] = _split(fn(*args, **kwargs), pipeline.return_lse, f"oracle {name}")
        except NotApplicable as whole:
            if not pipeline.return_lse:
                skipped[name] = whole.reason
                continue
            try:  # the LSE cannot be expressed; maybe the output alone can
                outs[name] = fn(*args, **pipeline.with_(return_lse=False).kwargs())
                skipped[f"{name} lse"] = whole.reason
            except NotApplicable as again:
                skipped[name] = again.reason
    lses = {n: x for n, x in lses.items() if x is not None and n in outs}
    mx.eval(*outs.values(), *lses.values())
    return outs, lses, skipped


def _host(x) -> np.ndarray:
    return np.array(x.astype(mx.float32) if isinstance(x, mx.array) else x, dtype=np.float64)


def compare(out, args: tuple, kwargs: dict) -> Comparison:
    return_lse = ScorePipeline.of(kwargs).return_lse
    out, out_lse = _split(out, return_lse, "the output under test")
    ref, ref_lse = _split(float64(*args, **kwargs), return_lse, "oracle float64")
    outs, lses, skipped = _run_oracles(args, kwargs)
    allowed = allowance(args, (ref, ref_lse) if return_lse else ref, outs.get("sdpa"), kwargs)
    allowed, allowed_lse = allowed if return_lse else (allowed, None)
    self_errors = {name: max_abs_error(o, ref) for name, o in outs.items()}
    ref_out = {name: np.array(o.astype(mx.float32)) for name, o in outs.items()}
    scale = ref_scale(ref)
    lse_verdicts = {}
    if return_lse:
        lse_self = {name: lse_error(x, ref_lse) for name, x in lses.items()}
        lse_ref = {name: _host(x) for name, x in lses.items()}
        lse_verdicts = dict(
            lse_against_float64=Verdict(lse_error(out_lse, ref_lse), allowed_lse, lse_scale(ref_lse)),
            lse_oracle_self={name: Verdict(e, allowed_lse, lse_scale(ref_lse)) for name, e in lse_self.items()},
            lse_against_oracle={name: Verdict(lse_error(out_lse, lse_ref[name]), allowed_lse + lse_self[name],
                                              lse_scale(lse_ref[name]))
                                for name in lses})
    return Comparison(
        against_float64=Verdict(max_abs_error(out, ref), allowed, scale),
        oracle_self={name: Verdict(e, allowed, scale) for name, e in self_errors.items()},
        against_oracle={name: Verdict(max_abs_error(out, ref_out[name]), allowed + self_errors[name],
                                      ref_scale(ref_out[name]))
                        for name in outs},
        not_applicable=skipped,
        **lse_verdicts,
    )
