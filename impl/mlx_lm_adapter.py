"""Paged K/V for mlx-lm models: per-layer views that speak mlx-lm's cache protocol.

mlx-lm's attention layers call, per layer: `cache.offset` (RoPE position, before the
new tokens), `cache.update_and_fetch(keys, values)`, and the model calls
`cache.make_mask(N, ...)` once; the attention itself goes through the module-level name
`scaled_dot_product_attention`, which `patch_attention(module)` points at the paged
operator for calls that carry a `PagedLayerView`.

| object                 | job                                                              |
|------------------------|------------------------------------------------------------------|
| `PagedBatch(caches)`   | B requests (one `PagedCache` each) run as one batch              |
| `begin_step(L)`        | reserve L positions in every cache (all or nothing) and build the step's metadata once |
| `layer_views()`        | the list to pass as the model's `cache=`                         |
| `PagedLayerView`       | one layer of the batch: `offset`, `update_and_fetch`, `make_mask` |

`offset` is an int for one request and an int32 `[B]` array for a batch (mlx's RoPE
takes either), so requests of different lengths decode together without padding.
"""

from __future__ import annotations

import contextlib

import mlx.core as mx

from .batch import StepBatch
from .cache import PagedCache
from .errors import PoolExhausted, ServingError


class PagedBatch:
    def __init__(self, caches: list[PagedCache], *, window: int | None = None):
        if not caches:
            raise ServingError("request", "a paged batch needs at least one cache")
        self.caches, self.window = list(caches), window
        self.pool = caches[0].pool
        self.step: StepBatch | None = None
        self._views = [PagedLayerView(self, layer) for layer in range(self.pool.num_layers)]

    def begin_step(self, query_len: int) -> StepBatch:
        need = sum(c.pages_needed(query_len) for c in self.caches)
        free = self.pool.allocator.num_free
        if need > free:
            raise PoolExhausted(f"the batch needs {need} pages for {query_len} more positions each, {free} are free")
        for c in self.caches:
            c.reserve(query_len)
        self.step = StepBatch(self.caches, query_len)
        return self.step

    def layer_views(self) -> list[PagedLayerView]:
        return list(self._views)


class PagedLayerView:
    def __init__(self, batch: PagedBatch, layer: int):
        self.batch, self.layer = batch, layer

    def _step(self) -> StepBatch:
        if self.batch.step is None:
            raise ServingError("request", "call PagedBatch.begin_step(L) before running the model")
        return self.batch.step

    @property
    def offset(self):
        positions = self._step().positions
        return int(positions[0]) if len(positions) == 1 else mx.array(positions)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        step = self._step()
        step.write(self.layer, keys, values)
        return step.pool.keys(self.layer), step.pool.values(self.layer)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        if N != self._step().query_len:
            raise ServingError("append_shape", f"the model runs {N} positions, the step reserved {self._step().query_len}")
        if window_size is not None and window_size != self.batch.window:
            raise ServingError("request", f"the model asks for window {window_size}; build the PagedBatch with it")
        return "causal" if N > 1 else None  # positions come from context_lens, not from a mask array

    def attend(self, queries: mx.array, scale: float, mask) -> mx.array:
        if not (mask is None or isinstance(mask, str) and mask == "causal"):
            raise ServingError("request", "paged attention takes its mask from context_lens; got an explicit mask array")
        return self._step().attend(self.layer, queries, scale=scale, window=self.batch.window)


def scaled_dot_product_attention(queries, keys, values, cache, scale: float, mask, sinks=None, *,
                                 fallback=None):
    """mlx-lm's attention entry point; paged for `PagedLayerView` caches."""
    if isinstance(cache, PagedLayerView):
        if sinks is not None:
            raise ServingError("request", "attention sinks are not supported by the paged operator")
        return cache.attend(queries, scale, mask)
    return fallback(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


@contextlib.contextmanager
def patch_attention(*modules):
    """Routes the modules' `scaled_dot_product_attention` through the paged operator."""
    saved = [(m, m.scaled_dot_product_attention) for m in modules]
    try:
        for m, original in saved:
            def paged(q, k, v, cache, scale, mask, sinks=None, _original=original):
                return scaled_dot_product_attention(q, k, v, cache, scale, mask, sinks, fallback=_original)
            m.scaled_dot_product_attention = paged
        yield
    finally:
        for m, original in saved:
            m.scaled_dot_product_attention = original
