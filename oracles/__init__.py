"""Independent references for the paged-attention contract (REFERENCE.md section 1).

| oracle     | module       | how it computes                                             |
|------------|--------------|-------------------------------------------------------------|
| `equation` | equation.py  | mlx.core, per request: take pages, scores, mask, softmax, sum |
| `dense`    | dense.py     | vectorized dense gather + batched masked attention (mlx)    |
| `sdpa`     | sdpa.py      | per-request concat of pages + `mx.fast.scaled_dot_product_attention` |
| `float64`  | numpy64.py   | NumPy float64, key by key through the addressing formula    |

None imports impl/. All take the operator's arguments; the first three return an
`mx.array` in the query's dtype, `float64` returns a float64 NumPy array.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from . import dense, equation, numpy64, sdpa


def _host(x):
    """Host copy for the float64 oracle; half types widen exactly to float32 first."""
    if isinstance(x, mx.array) and x.dtype in (mx.float16, mx.bfloat16):
        x = x.astype(mx.float32)
    return np.array(x)


def float64(query, key_pages, value_pages, block_table, context_lens, page_size, *,
            scale=None, mask="causal", window=None) -> np.ndarray:
    return numpy64.attention_f64(_host(query), _host(key_pages), _host(value_pages), _host(block_table),
                                 _host(context_lens), page_size, scale=scale, mask=mask, window=window)


MLX_ORACLES = {"equation": equation.attention, "dense": dense.attention, "sdpa": sdpa.attention}

__all__ = ["MLX_ORACLES", "dense", "equation", "float64", "numpy64", "sdpa"]
