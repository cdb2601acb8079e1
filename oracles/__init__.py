"""Independent references for the paged-attention contract (REFERENCE.md sections 1, 1b).

| oracle     | module       | how it computes                                             |
|------------|--------------|-------------------------------------------------------------|
| `equation` | equation.py  | mlx.core, per request: take pages, scores, cap, bias, mask, explicit max / exp / sum (a sink in the max and the sum) |
| `dense`    | dense.py     | vectorized dense gather + batched masked attention (mlx); a sink rescales the keys' softmax by sigmoid(lse_keys - sigma) |
| `sdpa`     | sdpa.py      | per-request concat of pages + `mx.fast.scaled_dot_product_attention` (ALiBi as its additive mask, its `sinks=`) |
| `float64`  | numpy64.py   | NumPy float64, key by key through the addressing formula    |
| `merge_states64` | merge64.py | NumPy float64 merge of two partial states (o, lse)    |
| `quantization_error` | here | float64 max abs difference: attention over the dequantized pages vs over the given unquantized ones |

None imports impl/. All take the operator's arguments and its keyword options (the
score pipeline, contract/pipeline.py, read through `ScorePipeline.of`: an unknown
keyword is a TypeError); the first three return an `mx.array` in the query's dtype,
`float64` a float64 NumPy array; with `return_lse=True` each returns `(out, lse)`, lse
`[B, Hq, L]` (float32 from MLX, float64 from `float64`). Where an oracle cannot express
a call (MLX SDPA has no soft-cap and returns no LSE) it raises `NotApplicable` rather
than answer something else; callers leave it out and keep the reason.

Quantized pages (`kv_dtype`, `k_scale`, `v_scale`; contract/kv_format.py): every oracle
computes attention over the dequantized K/V `decode(code) * scale`, each decoding on its
own by another method, sharing nothing with impl/, fixtures/ or each other:

| oracle     | decode                                                                      |
|------------|-----------------------------------------------------------------------------|
| `float64`  | sign / exponent / mantissa fields by the formula, NumPy float64             |
| `equation` | MLX integer bit operations into float16 bit patterns, `view`ed (e4m3 times 2^8) |
| `dense`    | a 256-entry table built with `np.ldexp(significand, exponent)`, `mx.take`   |
| `sdpa`     | `mx.from_fp8` (e4m3), float arithmetic on the fields (e5m2); SDPA in float32 |

Scales by shape: `[]` everywhere, `[Hkv]` per KV head, `[P, Hkv, ps]` at the physical
`[page, g, slot]`. The error of the quantization itself (the rounding of K/V to 8 bits,
which is not the kernel's) is `quantization_error`, reported apart per format.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from contract import ScorePipeline


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


def quantization_error(args: tuple, kwargs: dict, key_pages_float, value_pages_float) -> float:
    """max |o_q - o_f| in float64: o_q the float64 oracle on the call (`args` positional,
    `kwargs` with a kv_dtype), o_f the same call over the unquantized pages given (any float
    dtype, shaped as the code pages) with no kv_dtype or scales. The output only (with
    return_lse, its first part); NaN or inf in either makes it inf."""
    plain = ScorePipeline.of(kwargs)
    if not plain.kv.quantized:
        raise ValueError("quantization_error needs a call with a kv_dtype")
    plain = plain.with_(kv_dtype=None, k_scale=None, v_scale=None)
    quantized = float64(*args, **kwargs)
    unquantized = float64(args[0], key_pages_float, value_pages_float, *args[3:], **plain.kwargs())
    if plain.return_lse:
        quantized, unquantized = quantized[0], unquantized[0]
    diff = np.abs(quantized - unquantized)
    if diff.size == 0:
        return 0.0
    return float(diff.max()) if np.isfinite(diff).all() else float("inf")


MLX_ORACLES = {"equation": equation.attention, "dense": dense.attention, "sdpa": sdpa.attention}

__all__ = ["MLX_ORACLES", "NotApplicable", "dense", "equation", "float64", "merge_states64", "numpy64",
           "quantization_error", "sdpa"]
