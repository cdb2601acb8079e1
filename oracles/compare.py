"""One output against all four oracles under the tolerance rule.

`float64` is the reference. Each MLX oracle must itself pass the rule against it (so a
broken oracle is reported as such), and the output must be within the allowance plus
that oracle's own error of each MLX oracle (triangle inequality).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from . import MLX_ORACLES, float64
from .tolerance import Verdict, allowed_error, max_abs_error, ref_scale


@dataclass(frozen=True)
class Comparison:
    against_float64: Verdict
    oracle_self: dict  # name -> Verdict of that oracle against float64
    against_oracle: dict  # name -> Verdict of the output against that oracle

    def failures(self) -> list[str]:
        bad = [f"oracle {n} itself: {v}" for n, v in self.oracle_self.items() if not v.ok]
        if not self.against_float64.ok:
            bad.append(f"vs float64: {self.against_float64}")
        bad += [f"vs {n}: {v}" for n, v in self.against_oracle.items() if not v.ok]
        return bad


def value_scale(value_pages) -> float:
    v = np.array(value_pages.astype(mx.float32))
    finite = np.abs(v[np.isfinite(v)])
    return float(finite.max()) if finite.size else 1.0


def allowance(args: tuple, ref: np.ndarray, sdpa_out) -> float:
    """The tolerance rule's allowance for one call (`args` positional, the value pool third)
    given the float64 answer and the SDPA oracle's output on it."""
    return allowed_error(args[0].dtype, ref, max_abs_error(sdpa_out, ref), value_scale(args[2]))


def reference(args: tuple, kwargs: dict) -> tuple[np.ndarray, float]:
    """The float64 oracle's answer on one call and the tolerance rule's allowance for it."""
    ref = float64(*args, **kwargs)
    sdpa_out = MLX_ORACLES["sdpa"](*args, **kwargs)
    mx.eval(sdpa_out)
    return ref, allowance(args, ref, sdpa_out)


def compare(out, args: tuple, kwargs: dict) -> Comparison:
    ref = float64(*args, **kwargs)
    outs = {name: fn(*args, **kwargs) for name, fn in MLX_ORACLES.items()}
    mx.eval(*outs.values())
    allowed = allowance(args, ref, outs["sdpa"])
    self_errors = {name: max_abs_error(o, ref) for name, o in outs.items()}
    ref_out = {name: np.array(o.astype(mx.float32)) for name, o in outs.items()}
    scale = ref_scale(ref)
    return Comparison(
        against_float64=Verdict(max_abs_error(out, ref), allowed, scale),
        oracle_self={name: Verdict(e, allowed, scale) for name, e in self_errors.items()},
        against_oracle={name: Verdict(max_abs_error(out, ref_out[name]), allowed + self_errors[name],
                                      ref_scale(ref_out[name]))
                        for name in outs},
    )
