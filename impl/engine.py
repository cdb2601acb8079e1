"""Engines: run a scheduled step's attention for every layer, over one of the stores.

A step is cut into groups that share a query length: each prefill chunk alone, all
decodes together. Per group the metadata is built once; per layer the engine writes
the group's new K/V and attends. The three variants differ only in where attention
reads K/V from, and all run the same kernel, so their outputs must agree bit for bit:

| variant        | store        | before attention, each layer...                         |
|----------------|--------------|---------------------------------------------------------|
| `paged`        | `PagedStore` | nothing: the kernel walks the block table                |
| `paged_gather` | `PagedStore` | gathers each request's pages into a padded dense batch   |
| `dense`        | `DenseStore` | appends to each request's dense K/V (a concatenation) and repacks the padded batch |

`inputs[layer] = (q, k, v)` with q `[B, Hq, L, D]`, k and v `[B, Hkv, L, D]`, rows in the
group's order. Nothing here syncs with the host; callers evaluate the outputs.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .attention import paged_attention_with_metadata
from .batch import StepBatch
from .stores import DenseStore, PagedStore
from .validation import PagedMetadata

VARIANTS = ("paged", "paged_gather", "dense")


def step_groups(step) -> list[list]:
    return [[w] for w in step.prefills] + ([step.decodes] if step.decodes else [])


def _dense_metadata(lengths, query_len: int, width: int) -> PagedMetadata:
    # A dense batch [B, Hkv, S, D] is a pool of B pages of S positions, page b for row b.
    B = len(lengths)
    return PagedMetadata.build(np.arange(B, dtype=np.int32)[:, None], np.asarray(lengths, dtype=np.int32),
                               page_size=width, num_pages=B, query_len=query_len)


class PagedEngine:
    def __init__(self, store: PagedStore, *, gather: bool = False, scale=None):
        self.store, self.gather, self.scale = store, gather, scale
        self.kv_bytes_copied = 0     # bytes moved besides the new rows (gathers)
        self.last_transient_bytes = 0  # one layer's gathered K/V batch in the last group

    def run_group(self, works, inputs) -> list[mx.array]:
        caches = [self.store.caches[w.request.rid] for w in works]
        batch = StepBatch(caches, works[0].count)
        pool = self.store.pool
        if self.gather:
            width = batch.metadata.block_table_host.shape[1]
            index = mx.array(np.maximum(batch.metadata.block_table_host, 0).reshape(-1))
            dense_meta = _dense_metadata(batch.metadata.context_lens_host, batch.query_len, width * pool.page_size)
            gathered = len(caches) * width * pool.bytes_per_page // pool.num_layers
        self.last_transient_bytes = gathered if self.gather else 0
        outs = []
        for layer, (q, k, v) in enumerate(inputs):
            batch.write(layer, k, v)
            if not self.gather:
                outs.append(batch.attend(layer, q, scale=self.scale))
                continue
            kb, vb = (self._gather(x, index, len(caches)) for x in (pool.keys(layer), pool.values(layer)))
            # take + transpose materialize the K and V batch twice each
            self.kv_bytes_copied += 2 * gathered
            outs.append(paged_attention_with_metadata(q, kb, vb, dense_meta, scale=self.scale,
                                                      **self._gathered_options(pool.kv_options(layer), index,
                                                                               len(caches))))
        return outs

    @staticmethod
    def _gather(pages: mx.array, index: mx.array, batch: int) -> mx.array:
        """Pages [P, H, ps, D] (or a quantized pool's token scales [P, H, ps]) gathered into
        one page per request, [batch, H, width * ps(, D)]."""
        x = mx.take(pages, index, axis=0).reshape(batch, -1, *pages.shape[1:])
        x = mx.swapaxes(x, 1, 2)
        return mx.contiguous(x.reshape(batch, pages.shape[1], -1, *pages.shape[3:]))

    @classmethod
    def _gathered_options(cls, options: dict, index: mx.array, batch: int) -> dict:
        """A quantized pool's kv_options for the gathered pages: token scales travel with
        their rows; tensor and head scales hold as they are."""
        return {name: cls._gather(x, index, batch) if name.endswith("_scale") and x.ndim == 3 else x
                for name, x in options.items()}


class DenseEngine:
    def __init__(self, store: DenseStore, *, scale=None):
        self.store, self.scale = store, scale
        self.kv_bytes_copied = 0     # bytes moved besides the new rows (concatenations, repacks)
        self.last_transient_bytes = 0  # one layer's repacked K/V batch in the last group

    def run_group(self, works, inputs) -> list[mx.array]:
        L, B = works[0].count, len(works)
        lengths = [self.store.lengths[w.request.rid] for w in works]
        width = max(lengths)
        meta = _dense_metadata(lengths, L, width)
        item = self.store.dtype.size
        outs = []
        self.last_transient_bytes = 0
        for layer, (q, k, v) in enumerate(inputs):
            batch = []
            for b, w in enumerate(works):
                pair = self.store.kv[w.request.rid][layer]
                for i, new in enumerate((k[b], v[b])):
                    old = pair[i]
                    pair[i] = new if old is None else mx.concatenate([old, new], axis=1)
                    if old is not None:
                        self.kv_bytes_copied += old.nbytes
                batch.append(pair)
            if B == 1:
                kb, vb = batch[0][0][None], batch[0][1][None]
            else:
                kb, vb = (mx.stack([mx.pad(pair[i], [(0, 0), (0, width - pair[i].shape[1]), (0, 0)])
                                    for pair in batch]) for i in (0, 1))
                repacked = 2 * B * self.store.kv_heads * width * self.store.head_dim * item
                self.kv_bytes_copied += repacked
                self.last_transient_bytes = repacked
            outs.append(paged_attention_with_metadata(q, kb, vb, meta, scale=self.scale))
        return outs


def make_engine(variant: str, store, *, scale=None):
    if variant == "paged":
        return PagedEngine(store, scale=scale)
    if variant == "paged_gather":
        return PagedEngine(store, gather=True, scale=scale)
    if variant == "dense":
        return DenseEngine(store, scale=scale)
    raise ValueError(f"unknown variant {variant!r}; expected one of {VARIANTS}")
