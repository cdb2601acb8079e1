"""Independent references for the paged-attention contract (REFERENCE.md sections 1, 1b).

| oracle     | module       | how it computes                                             |
|------------|--------------|-------------------------------------------------------------|
| `equation` | equation.py  | mlx.core, per request: take pages, scores, cap, bias, mask, explicit max / exp / sum (a sink in the max and the sum) |
| `dense`    | dense.py     | vectorized dense gather + batched masked attention (mlx); a sink rescales the keys' softmax by sigmoid(lse_keys - sigma) |
| `sdpa`     | sdpa.py      | per-request concat of pages + `mx.fast.scaled_dot_product_attention` (ALiBi as its additive mask, its `sinks=`) |
| `float64`  | numpy64.py   | NumPy float64, key by key through the addressing formula    |
| `merge_states64` | merge64.py | NumPy float64 merge of two partial states (o, lse)    |

None imports impl/. All take the operator's arguments and its keyword options (the
score pipeline, contract/pipeline.py, read through `ScorePipeline.of`: an unknown
keyword is a TypeError); the first three return an `mx.array` in the query's dtype,
`float64` a float64 NumPy array; with `return_lse=True` each returns `(out, lse)`, lse
`[B, Hq, L]` (float32 from MLX, float64 from `float64`). Where an oracle cannot express
a call (MLX SDPA has no soft-cap and returns no LSE) it raises `NotApplicable` rather
than answer something else; callers leave it out and keep the reason.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np


class NotApplicable(Exception):
    """The oracle cannot express this call; `reason` says which part and why."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


from . import dense, equation, numpy64, sdpa  # noqa: E402  (sdpa raises NotApplicable, defined above)
from .merge64 import merge_states64  # noqa: E402


def _host(x):
    """Host copy for the float64 oracle; half types widen exactly to float32 first."""
    if isinstance(x, mx.array) and x.dtype in (mx.float16, mx.bfloat16):
        x = x.astype(mx.float32)
    return np.array(x)


def float64(query, key_pages, value_pages, block_table, context_lens, page_size, **options):
    """The float64 oracle on MLX (or any array-like) arguments: out, or (out, lse) with
    return_lse. The options pass through unchanged; numpy64 converts slopes and sinks."""
    return numpy64.attention_f64(_host(query), _host(key_pages), _host(value_pages), _host(block_table),
                                 _host(context_lens), page_size, **options)


MLX_ORACLES = {"equation": equation.attention, "dense": dense.attention, "sdpa": sdpa.attention}

__all__ = ["MLX_ORACLES", "NotApplicable", "dense", "equation", "float64", "merge_states64", "numpy64", "sdpa"]
