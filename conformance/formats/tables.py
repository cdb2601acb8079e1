"""Page tables: pagecheck's padded `block_table` + `context_lens`, and FlashInfer's CSR.

| page_table | arrays the kernel gets                                          | used by                 |
|------------|-----------------------------------------------------------------|-------------------------|
| `padded`   | `block_table` `[B, max_pages]`, `seq_lens` `[B]` (keys per request, the new ones included) | pagecheck, vLLM, FlashAttention (`cache_seqlens`) |
| `csr`      | `kv_indptr` `[B + 1]`, `kv_indices` `[nnz]`, `kv_last_page_len` `[B]` | FlashInfer            |

CSR lists only the pages a request reads: request b owns `kv_indices[kv_indptr[b]:kv_indptr[b+1]]`
and its context is `(n - 1) * page_size + kv_last_page_len[b]` with `1 <= last <= page_size`;
an empty slot owns no page and has last 0. The metadata keep their dtype (an int64 table
stays int64, so a kernel's dtype check still sees it). A negative context or a row needing
more pages than its table row holds has no CSR image: `NotExpressible`.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .errors import NotExpressible


def pack(page_table: str, block_table: mx.array, context_lens: mx.array, page_size: int) -> dict:
    if page_table == "padded":
        return {"block_table": block_table, "seq_lens": context_lens}
    if page_table != "csr":
        raise ValueError(f"unknown page table {page_table!r}")
    table, lens = np.array(block_table), np.array(context_lens)
    if (lens < 0).any():
        raise NotExpressible("a negative context length has no image in page_table=csr")
    pages = -(-lens // page_size)
    if (pages > table.shape[1]).any():
        raise NotExpressible("a row needing more pages than max_pages has no image in page_table=csr "
                             "(CSR lists each row's pages; there is no table width)")
    indices = np.concatenate([table[b, :n] for b, n in enumerate(pages)] + [table[:0, 0]])
    indptr = np.concatenate([[0], np.cumsum(pages)]).astype(lens.dtype)
    last = np.where(pages > 0, lens - (pages - 1) * page_size, 0).astype(lens.dtype)
    return {"kv_indptr": mx.array(indptr), "kv_indices": mx.array(indices.astype(table.dtype)),
            "kv_last_page_len": mx.array(last)}


def unpack(page_table: str, arrays: dict, page_size: int, max_pages: int | None = None):
    """`(block_table, context_lens)` from the kernel's arrays; CSR rows are padded with -1
    to `max_pages` (default: the longest row)."""
    if page_table == "padded":
        return arrays["block_table"], arrays["seq_lens"]
    indptr, indices = np.array(arrays["kv_indptr"]), np.array(arrays["kv_indices"])
    last = np.array(arrays["kv_last_page_len"])
    pages = np.diff(indptr)
    width = int(pages.max(initial=0)) if max_pages is None else max_pages
    table = np.full((len(pages), max(width, 1)), -1, dtype=indices.dtype)
    for b, n in enumerate(pages):
        table[b, :n] = indices[indptr[b]:indptr[b + 1]]
    lens = np.where(pages > 0, (pages - 1) * page_size + last, 0).astype(last.dtype)
    return mx.array(table), mx.array(lens)
