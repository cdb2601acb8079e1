"""Conventions that differ between systems, converted here and nowhere else.

| pagecheck (REFERENCE.md)        | `count` (vLLM, HF) | `flash` (FlashAttention)  | `flashinfer`        |
|---------------------------------|--------------------|---------------------------|---------------------|
| `mask="causal"`, no window      | `window=None`      | `window_size=(-1, -1)`, `causal=True` | `window_left=-1` |
| `mask="causal"`, window w >= 1  | `window=w`         | `window_size=(w - 1, 0)`  | `window_left=w - 1` |
| `mask=None`                     | `causal=False`     | `causal=False`, `(-1, -1)` | `causal=False`, `-1` |
| window w < 1 (rejected)         | `window=w`         | no image: any negative left is "no window" | no image (same) |
| window with `mask=None` (rejected) | passed as given | no image: `(w - 1, -1)` is a valid local window there | no image (the same) |

A query at position p with window w sees keys `p - w < j <= p`: w keys, itself
included; FlashAttention and FlashInfer count the keys left of the query instead.
"""

from __future__ import annotations

from .errors import NotExpressible


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
