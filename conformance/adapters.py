"""Adapters that put other kinds of kernels behind the `mlx.core.array` contract.

`from_numpy(fn, **capabilities)` wraps a kernel that takes and returns NumPy arrays:

    # mykernel.py
    from conformance.adapters import from_numpy

    def attention_np(query, key_pages, value_pages, block_table, context_lens, page_size,
                     *, scale=None, mask="causal", window=None):
        ...  # NumPy in, NumPy out

    paged_attention = from_numpy(attention_np, dtypes=["float32", "float16"])

    # pytest -m correctness --impl mykernel:paged_attention

| boundary        | what the adapter does                                                    |
|-----------------|--------------------------------------------------------------------------|
| array arguments | must be `mlx.core.array` (else TypeError: the contract's type rule); copied to NumPy with their dtype, except bfloat16, which NumPy lacks: widened exactly to float32 |
| other arguments | passed through unchanged (page_size, scale, mask, window), so the kernel's own checks see them as given |
| result          | must be a NumPy array (else TypeError); converted once to the query's dtype (the kernel may return float32 or float64: the adapter owns the final rounding) |
| capabilities    | keyword arguments, or the wrapped function's own `pagecheck_capabilities` |

Exceptions the kernel raises pass through untouched, so its rejections are what the
rejection checks see.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np

_ARRAYS = ("query", "key_pages", "value_pages", "block_table", "context_lens")


def _to_numpy(name: str, x) -> np.ndarray:
    if not isinstance(x, mx.array):
        raise TypeError(f"{name} must be an mlx.core.array, got {type(x).__name__}")
    if x.dtype == mx.bfloat16:
        x = x.astype(mx.float32)
    return np.array(x)


def from_numpy(fn, **capabilities):
    """The NumPy kernel `fn` as an implementation of the contract (see the module table)."""

    @functools.wraps(fn)
    def paged_attention(query, key_pages, value_pages, block_table, context_lens, page_size, *,
                        scale=None, mask="causal", window=None):
        arrays = [_to_numpy(n, x) for n, x in zip(_ARRAYS, (query, key_pages, value_pages, block_table,
                                                            context_lens))]
        out = fn(*arrays, page_size, scale=scale, mask=mask, window=window)
        if not isinstance(out, np.ndarray):
            raise TypeError(f"{fn.__name__} returned {type(out).__name__}, expected a NumPy array")
        return mx.array(out.astype(np.float32) if out.dtype == np.float64 else out).astype(query.dtype)

    declared = dict(getattr(fn, "pagecheck_capabilities", None) or {})
    declared.update(capabilities)
    paged_attention.pagecheck_capabilities = declared
    return paged_attention
