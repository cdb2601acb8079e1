"""Conventions that differ between systems, converted here and nowhere else.

Windows (`window_convention`):

| pagecheck (REFERENCE.md)        | `count` (vLLM, HF) | `flash` (FlashAttention)  | `flashinfer`        |
|---------------------------------|--------------------|---------------------------|---------------------|
| `mask="causal"`, no window      | `window=None`      | `window_size=(-1, -1)`, `causal=True` | `window_left=-1` |
| `mask="causal"`, window w >= 1  | `window=w`         | `window_size=(w - 1, 0)`  | `window_left=w - 1` |
| `mask=None`                     | `causal=False`     | `causal=False`, `(-1, -1)` | `causal=False`, `-1` |
| window w < 1 (rejected)         | `window=w`         | no image: any negative left is "no window" | no image (same) |
| window with `mask=None` (rejected) | passed as given | no image: `(w - 1, -1)` is a valid local window there | no image (the same) |

A query at position p with window w sees keys `p - w < j <= p`: w keys, itself
included; FlashAttention and FlashInfer count the keys left of the query instead.

The log-sum-exp and ALiBi (contract v2, REFERENCE.md 1b). pagecheck's lse is
`m + ln d` (natural log, sinks included, `-inf` for an empty row) and its ALiBi bias
`slope_h * (j - p)`, added after the soft-cap. A kernel declaring another convention
gets the same slopes; its lse is brought back to pagecheck's (`lse_back`), in this
order, and a call whose *output* differs under its convention has no faithful image
(`alibi_expressible`: `NotExpressible`, a skip with the reason):

| key                | value             | the kernel's                          | converted back / no image                 | used by |
|--------------------|-------------------|---------------------------------------|-------------------------------------------|---------|
| `lse_convention`   | `natural`         | `ln sum e^s`                          | as is                                      | pagecheck, FlashAttention 3, vLLM |
|                    | `base2`           | `log2 sum e^s` (= lse / ln 2)         | `lse = lse2 * ln 2`                        | FlashInfer |
| `empty_lse`        | `-inf`            | `-inf` for an empty row               | as is                                      | pagecheck, FlashAttention 3 |
|                    | `+inf`            | `+inf` for an empty row               | `+inf -> -inf` where the row is empty (context 0) only; a `+inf` elsewhere stays and fails | FlashAttention 2 |
| `alibi_convention` | `position`        | `slope * (j - p)`                     | as is                                      | pagecheck, FlashInfer's offset |
|                    | `context_end`     | `slope * (j - ctx + 1)`               | same output (softmax is shift-invariant per row); `lse -= slope * (p - ctx + 1)`; with sinks no image (the sink is not shifted) | vLLM CUDA |
|                    | `abs_distance`    | `-slope * abs(p - j)`                 | the same under causal masking (j <= p); `mask=None` with slopes: no image | FlashAttention 2 |
|                    | `bias_before_cap` | `c * tanh((s + bias) / c)`            | the same without a soft-cap; soft-cap and slopes together: no image | FlashInfer |

`p = ctx - L + l` is query row l's position, ctx the request's context. The lse is
converted in float64 and written back in the kernel's own dtype (a wrong lse dtype
still fails the check); an lse of an unexpected shape comes back untouched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .errors import NotExpressible

LN2 = math.log(2.0)


def causal_flag(mask) -> bool:
    if mask == "causal":
        return True
    if mask is None:
        return False
    raise NotExpressible(f"mask={mask!r} has no image in a causal flag (only 'causal' or None do)")


def window_args(convention: str, window, mask) -> dict:
    """The kernel's window argument(s) for pagecheck's `window` (a key count or None)."""
    if convention == "count":
        return {"window": window}
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)):
        raise NotExpressible(f"window={window!r} is not an int")
    if window is not None and window < 1:
        raise NotExpressible(f"window={window} < 1: in the {convention} convention every negative "
                             f"left size means 'no window', so the rejected call would become a valid one")
    if window is not None and mask is None:
        raise NotExpressible(f"window={window} with mask=None: a left window without causal masking is a valid "
                             f"non-causal local window in the {convention} convention")
    if convention == "flash":
        return {"window_size": (-1, -1) if window is None else (window - 1, 0)}
    if convention == "flashinfer":
        return {"window_left": -1 if window is None else window - 1}
    raise ValueError(f"unknown window convention {convention!r}")


def window_count(convention: str, args: dict):
    """pagecheck's window (a key count or None) from the kernel's argument(s): the inverse."""
    if convention == "count":
        return args["window"]
    if convention == "flash":
        left, right = args["window_size"]
        if left < 0:
            return None
        if right != 0:
            raise ValueError(f"window_size={args['window_size']}: only causal windows (right 0) have a key count")
        return left + 1
    left = args["window_left"]
    return None if left < 0 else left + 1


# -- ALiBi ---------------------------------------------------------------------------------

def alibi_bias(convention: str, slope: float, key: np.ndarray, position: int, context: int) -> np.ndarray:
    """The bias a kernel of `convention` adds to query position `position`'s score of
    key positions `key` (the definitions of the table; for tests and references)."""
    if convention in ("position", "bias_before_cap"):
        return slope * (key - position)
    if convention == "context_end":
        return slope * (key - context + 1)
    if convention == "abs_distance":
        return -slope * np.abs(position - key)
    raise ValueError(f"unknown ALiBi convention {convention!r}")


def alibi_expressible(convention: str, pipeline) -> None:
    """Raises NotExpressible where a kernel of this ALiBi convention computes another
    *output* than pagecheck's on this call (`pipeline`: contract.ScorePipeline)."""
    if pipeline.alibi_slopes is None or convention == "position":
        return
    if convention == "context_end":
        if pipeline.sinks is not None:
            raise NotExpressible("ALiBi at j - ctx + 1 (alibi_convention context_end) with sinks: the scores are "
                                 "shifted by slope * (p - ctx + 1) and the sink is not, so the output differs")
    elif convention == "abs_distance":
        if pipeline.mask is None:
            raise NotExpressible("ALiBi as -slope * |p - j| (alibi_convention abs_distance) with mask=None: keys "
                                 "past the query get another bias than slope * (j - p)")
    elif convention == "bias_before_cap":
        if pipeline.softcap is not None:
            raise NotExpressible("ALiBi added before the soft-cap's tanh (alibi_convention bias_before_cap) with "
                                 "a soft-cap: pagecheck adds it after the cap")
    else:
        raise ValueError(f"unknown ALiBi convention {convention!r}")


# -- the log-sum-exp -----------------------------------------------------------------------

@dataclass(frozen=True)
class Rows:
    """Where each entry of an lse sits, broadcastable against it: `empty` (its request
    has context 0) and `to_end` (`p - ctx + 1`: 0 for a request's last row)."""

    empty: np.ndarray
    to_end: np.ndarray
    head_axis: int  # the lse's head axis (the slopes lie along it)

    @classmethod
    def padded(cls, context_lens, L: int) -> Rows:
        """An lse `[B, Hq, L]`: row l of request b sits at `ctx - L + l`."""
        ctx = np.array(context_lens).astype(np.int64).reshape(-1, 1, 1)
        rows = np.arange(L, dtype=np.float64).reshape(1, 1, L)
        return cls(ctx == 0, np.broadcast_to(rows - L + 1, (ctx.shape[0], 1, L)), head_axis=1)

    @classmethod
    def packed(cls, cu_seqlens_q, context_lens) -> Rows:
        """A packed lse `[T, Hq]`: request b's n rows are its last n positions."""
        cu = np.array(cu_seqlens_q).astype(np.int64)
        ctx = np.array(context_lens).astype(np.int64)
        empty, to_end = [], []
        for b in range(len(cu) - 1):
            n = int(cu[b + 1] - cu[b])
            empty += [ctx[b] == 0] * n
            to_end += list(range(1 - n, 1))
        return cls(np.array(empty, dtype=bool).reshape(-1, 1), np.array(to_end, dtype=np.float64).reshape(-1, 1),
                   head_axis=1)


def converts_lse(caps) -> bool:
    return (caps.lse_convention, caps.empty_lse, caps.alibi_convention) != ("natural", "-inf", "position")


def lse_back(caps, lse, pipeline, rows: Rows):
    """The kernel's lse (in the conventions `caps` declares) in pagecheck's: natural log,
    `-inf` for an empty row, ALiBi at `j - p`. Anything but an mx.array of the rows'
    shape comes back untouched (the check then says what is wrong with it)."""
    if not converts_lse(caps) or not isinstance(lse, mx.array) or lse.ndim != rows.empty.ndim:
        return lse
    x = np.array(lse.astype(mx.float32) if lse.dtype in (mx.float16, mx.bfloat16) else lse, dtype=np.float64)
    try:
        np.broadcast_shapes(x.shape, rows.empty.shape)
    except ValueError:
        return lse
    if caps.lse_convention == "base2":
        x = x * LN2
    elif caps.lse_convention != "natural":
        raise ValueError(f"unknown lse convention {caps.lse_convention!r}")
    if caps.empty_lse == "+inf":
        x = np.where(rows.empty & (x == np.inf), -np.inf, x)
    if caps.alibi_convention == "context_end" and isinstance(pipeline.alibi_slopes, (mx.array, np.ndarray)):
        slopes = np.array(pipeline.alibi_slopes, dtype=np.float64)
        if slopes.ndim != 1 or slopes.shape[0] != x.shape[rows.head_axis]:
            return lse
        shape = [1] * x.ndim
        shape[rows.head_axis] = -1
        with np.errstate(invalid="ignore"):  # -inf stays -inf; NaN stays NaN
            x = x - np.where(rows.empty, 0.0, slopes.reshape(shape) * rows.to_end)
    return mx.array(x.astype(np.float32)).astype(lse.dtype)
