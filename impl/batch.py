"""`StepBatch`: one step's metadata for requests that each add the same L positions.

Built once per step after the caches reserved their new positions, then shared by
every layer: the padded `block_table` (-1 past each row's pages) and `context_lens`
are validated once (`PagedMetadata`, host copies, no device sync), and so are the
slots the new K/V rows go to. Per layer the step only writes and attends.

| symbol       | meaning                                                  | type / shape       |
|--------------|----------------------------------------------------------|--------------------|
| `metadata`   | block table and context lengths for the operator         | `PagedMetadata`    |
| `positions`  | absolute position of each request's first new row        | int32 `[B]`        |
| `write(l, k, v)` | stores the step's new K/V of layer l                 | `[B, Hkv, L, D]`   |
| `attend(l, q)`   | paged attention of the step's queries over layer l (quantized pools: with their `kv_options`) | `[B, Hq, L, D]` |
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .attention import paged_attention_with_metadata
from .cache import PagedCache
from .errors import ServingError
from .validation import PagedMetadata


class StepBatch:
    def __init__(self, caches: list[PagedCache], query_len: int, *, min_width: int = 1):
        if not caches:
            raise ServingError("request", "a step batch needs at least one request")
        pool = caches[0].pool
        if any(c.pool is not pool for c in caches):
            raise ServingError("request", "every request of a step batch must use the same pool")
        self.pool, self.caches, self.query_len = pool, list(caches), query_len
        width = max([min_width] + [len(c.pages) for c in caches])
        table = np.full((len(caches), width), -1, dtype=np.int32)
        for b, c in enumerate(caches):
            table[b, :len(c.pages)] = c.pages
        lens = np.array([c.length for c in caches], dtype=np.int32)
        self.positions = lens - query_len
        self.metadata = PagedMetadata.build(table, lens, page_size=pool.page_size,
                                            num_pages=pool.num_pages, query_len=query_len)
        slots = np.concatenate([c.slots(c.length - query_len, query_len) for c in caches])
        self.slots = pool.prepare_slots(slots)

    @property
    def batch(self) -> int:
        return len(self.caches)

    def write(self, layer: int, keys: mx.array, values: mx.array) -> None:
        B, L = self.batch, self.query_len
        for name, x in (("keys", keys), ("values", values)):
            if x.ndim != 4 or x.shape[0] != B or x.shape[2] != L:
                raise ServingError("append_shape", f"{name} has shape {tuple(x.shape)}, expected "
                                                   f"[{B}, kv_heads, {L}, head_dim]")
        rows = [x.transpose(0, 2, 1, 3).reshape(B * L, x.shape[1], x.shape[3]) for x in (keys, values)]
        self.pool.write(layer, self.slots, *rows)

    def attend(self, layer: int, queries: mx.array, *, scale=None, window=None, sinks=None) -> mx.array:
        return paged_attention_with_metadata(queries, self.pool.keys(layer), self.pool.values(layer),
                                             self.metadata, scale=scale, mask="causal", window=window,
                                             sinks=sinks, **self.pool.kv_options(layer))
