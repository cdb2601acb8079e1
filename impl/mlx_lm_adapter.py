"""Paged K/V for mlx-lm models: per-layer views that speak mlx-lm's cache protocol.

mlx-lm's attention layers call, per layer: `cache.offset` (RoPE position, before the
new tokens), `cache.update_and_fetch(keys, values)`, and the model calls
`cache.make_mask(N, ...)` once per kind of layer; the attention itself goes through the
module-level name `scaled_dot_product_attention`, which `patch_attention(module)` points
at the paged operator for calls that carry a `PagedLayerView`.

| object                 | job                                                              |
|------------------------|------------------------------------------------------------------|
| `PagedBatch(caches)`   | B requests (one `PagedCache` each) run as one batch; `windows=`: one window (or None) per layer |
| `layer_windows(model)` | each layer's window, read off mlx-lm's own caches for the model  |
| `begin_step(L)`        | reserve L positions in every cache (all or nothing) and build the step's metadata once |
| `layer_views()`        | the list to pass as the model's `cache=`                         |
| `PagedLayerView`       | one layer of the batch: `offset`, `update_and_fetch`, `make_mask` |

`offset` is an int for one request and an int32 `[B]` array for a batch (mlx's RoPE
takes either), so requests of different lengths decode together without padding.

Sliding-window layers (gpt-oss, Gemma 3): mlx-lm keeps them in a `RotatingKVCache` of
`max_size = w` and masks with `window_size = w` (a query sees its last w keys, itself
included: the operator's `window`). The paged cache keeps every position, no rotation;
the window is the operator's, per layer. The model's `make_mask(N, window_size=w)` call
is checked against the layer's window, so a batch built with the wrong windows fails
loudly instead of decoding other tokens. Attention sinks (gpt-oss's per-head logit in
the softmax denominator) go to the operator's `sinks`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import mlx.core as mx

from .batch import StepBatch
from .cache import PagedCache
from .errors import PoolExhausted, ServingError


def layer_windows(model) -> list[int | None]:
    """Each layer's attention window as mlx-lm runs the model: `RotatingKVCache(max_size=w)`
    -> w, a dense `KVCache` -> None (full attention). Other caches (quantized, SSM state,
    a rotating cache that keeps its first tokens) are not attention over a window."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

    windows = []
    for layer, c in enumerate(make_prompt_cache(model)):
        if type(c) is KVCache:
            windows.append(None)
        elif type(c) is RotatingKVCache and c.keep == 0:
            windows.append(c.max_size)
        else:
            raise ServingError("request", f"layer {layer}: mlx-lm's cache {type(c).__name__}"
                                          f"{f' (keep={c.keep})' if isinstance(c, RotatingKVCache) else ''} "
                                          f"has no paged equivalent")
    return windows


class PagedBatch:
    """`window`: one window for every layer (None: full attention); `windows`: one per
    layer, a sequence of `num_layers` entries or a mapping layer -> window (missing
    layers: None), e.g. `layer_windows(model)`. Give one of the two at most."""

    def __init__(self, caches: list[PagedCache], *, window: int | None = None,
                 windows: list[int | None] | Mapping[int, int | None] | None = None):
        if not caches:
            raise ServingError("request", "a paged batch needs at least one cache")
        self.caches = list(caches)
        self.pool = caches[0].pool
        self.windows = self._per_layer(window, windows, self.pool.num_layers)
        self.step: StepBatch | None = None
        self._views = [PagedLayerView(self, layer) for layer in range(self.pool.num_layers)]

    @staticmethod
    def _per_layer(window, windows, num_layers: int) -> list[int | None]:
        if windows is None:
            return [window] * num_layers
        if window is not None:
            raise ServingError("request", "give either window (every layer) or windows (per layer), not both")
        if isinstance(windows, Mapping):
            bad = sorted(k for k in windows if not (isinstance(k, int) and 0 <= k < num_layers))
            if bad:
                raise ServingError("request", f"windows names layer {bad[0]!r}; "
                                              f"the pool has layers 0..{num_layers - 1}")
            return [windows.get(layer) for layer in range(num_layers)]
        windows = list(windows)
        if len(windows) != num_layers:
            raise ServingError("request", f"windows has {len(windows)} entries, the pool has {num_layers} layers")
        return windows

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

    @property
    def window(self) -> int | None:
        return self.batch.windows[self.layer]

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
        # A model that asks for no window (Qwen3 asks every layer the same) gets the
        # batch's: a window set on such a model narrows it on purpose (test_model's bite).
        if window_size is not None and window_size != self.window:
            raise ServingError("request", f"the model asks layer {self.layer} for window {window_size}, the batch "
                                          f"gives it {self.window}; build the PagedBatch with "
                                          f"windows=layer_windows(model)")
        return "causal" if N > 1 else None  # positions come from context_lens, not from a mask array

    def attend(self, queries: mx.array, scale: float, mask, sinks: mx.array | None = None) -> mx.array:
        if not (mask is None or isinstance(mask, str) and mask == "causal"):
            raise ServingError("request", "paged attention takes its mask from context_lens; got an explicit mask array")
        if sinks is not None and sinks.dtype != mx.float32:
            # The operator takes sinks as float32 [Hq]; a model held in bf16/f16 holds its
            # sinks in that dtype too (gpt-oss's `self.sinks`), and widening them is exact.
            sinks = sinks.astype(mx.float32)
        return self._step().attend(self.layer, queries, scale=scale, window=self.window, sinks=sinks)


def scaled_dot_product_attention(queries, keys, values, cache, scale: float, mask, sinks=None, *,
                                 fallback=None):
    """mlx-lm's attention entry point; paged for `PagedLayerView` caches."""
    if isinstance(cache, PagedLayerView):
        return cache.attend(queries, scale, mask, sinks)
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
