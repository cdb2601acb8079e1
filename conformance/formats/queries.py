"""Queries: pagecheck's padded `[B, Hq, L, D]` and the varlen packing `[T, Hq, D]`.

| query_packing | arrays the kernel gets                                              | output     | used by |
|---------------|---------------------------------------------------------------------|------------|---------|
| `padded`      | `query` `[B, Hq, L, D]`                                              | `[B, Hq, L, D]` | pagecheck |
| `varlen`      | `query` `[T, Hq, D]`, `cu_seqlens_q` int32 `[B + 1]`, `max_seqlen_q` int | `[T, Hq, D]` | FlashAttention varlen, vLLM (`query_start_loc`), FlashInfer (`qo_indptr`) |

With `return_lse` the kernel returns `(out, lse)`: lse `[B, Hq, L]` padded, `[T, Hq]`
packed (one entry per packed row and head); `unpack_lse` brings a packed one back to
`[B, Hq, L]`, `-inf` (an empty row's lse) where a request has no packed row.

Request b's query rows are `query[cu_seqlens_q[b]:cu_seqlens_q[b + 1]]`, in position order,
ending at its last key. A padded call's empty slot (context 0) packs as a request with no
query rows; its padded output rows are zeros by construction. Packed queries can hold
requests of different lengths in one batch (decode rows beside prefill chunks), which the
padded form cannot: `fixtures/mixed.py` builds such batches.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np


def query_lens(context_lens: mx.array, L: int) -> np.ndarray:
    """Rows per request when a padded call of length L is packed: L, or 0 for an empty slot."""
    return np.where(np.array(context_lens) == 0, 0, L).astype(np.int32)


def pack(query: mx.array, lens: np.ndarray) -> dict:
    """`query` `[B, Hq, L, D]` -> the varlen arrays, request b's last `lens[b]` rows."""
    B, Hq, L, D = query.shape
    rows = [query[b, :, L - int(n):].swapaxes(0, 1) for b, n in enumerate(lens) if n > 0]
    packed = mx.concatenate(rows, axis=0) if rows else mx.zeros((0, Hq, D), dtype=query.dtype)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    return {"query": packed, "cu_seqlens_q": mx.array(cu), "max_seqlen_q": int(max(lens, default=0))}


def unpack(packed: mx.array, cu_seqlens_q, L: int) -> mx.array:
    """`[T, Hq, D]` -> `[B, Hq, L, D]`: request b's rows at its last positions, zeros before
    them (an empty slot is all zeros)."""
    cu = np.array(cu_seqlens_q)
    T, Hq, D = packed.shape
    if T != int(cu[-1]):
        raise AssertionError(f"the kernel returned {T} packed rows, expected cu_seqlens_q[-1] = {int(cu[-1])}")
    out = []
    for b in range(len(cu) - 1):
        n = int(cu[b + 1] - cu[b])
        rows = packed[int(cu[b]):int(cu[b + 1])].swapaxes(0, 1)  # [Hq, n, D]
        pad = mx.zeros((Hq, L - n, D), dtype=packed.dtype)
        out.append(mx.concatenate([pad, rows], axis=1))
    return mx.stack(out) if out else mx.zeros((0, Hq, L, D), dtype=packed.dtype)


def unpack_lse(packed: mx.array, cu_seqlens_q, L: int) -> mx.array:
    """`[T, Hq]` -> `[B, Hq, L]`: request b's entries at its last positions, `-inf` before
    them (an empty slot is all `-inf`); the kernel's dtype is kept."""
    cu = np.array(cu_seqlens_q)
    if packed.ndim != 2 or packed.shape[0] != int(cu[-1]):
        raise AssertionError(f"the kernel returned an lse of shape {tuple(packed.shape)}, expected "
                             f"[cu_seqlens_q[-1], Hq] = [{int(cu[-1])}, Hq]")
    Hq = packed.shape[1]
    out = []
    for b in range(len(cu) - 1):
        n = int(cu[b + 1] - cu[b])
        rows = packed[int(cu[b]):int(cu[b + 1])].swapaxes(0, 1)  # [Hq, n]
        pad = mx.full((Hq, L - n), -float("inf"), dtype=packed.dtype)
        out.append(mx.concatenate([pad, rows], axis=1))
    return mx.stack(out) if out else mx.zeros((0, Hq, L), dtype=packed.dtype)
