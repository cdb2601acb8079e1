"""`PagedCache`: one request's view of the pool — its block table and context length.

| symbol        | meaning                                                        |
|---------------|----------------------------------------------------------------|
| `pages`       | the block-table row: logical page i -> physical page id, shared by every layer |
| `length`      | positions reserved so far (the context length once they are written) |
| `reserve(n)`  | room for n more positions: new pages only when the tail is full; a shared tail page is copied first (copy-on-write). Returns their slots. |
| `append(ks, vs)` | reserve and write n positions into every layer (`ks[l]`: `[n, Hkv, D]`) |
| `fork()`      | a second cache over the same pages (reference counts), e.g. a shared prompt |
| `release()`   | gives every page back exactly once; a second release is an error |

All changes are transactional: validated first, and an exhausted pool raises
`PoolExhausted` with the cache and the pool exactly as they were.
"""

from __future__ import annotations

import numpy as np

from .errors import PageAlreadyFree, ServingError
from .pool import PagePool


class PagedCache:
    def __init__(self, pool: PagePool, *, max_tokens: int | None = None):
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0):
            raise ServingError("capacity", f"max_tokens must be an int >= 0 or None, got {max_tokens!r}")
        self.pool = pool
        self.max_tokens = max_tokens
        self.pages: list[int] = []
        self.length = 0
        self.released = False

    @property
    def page_size(self) -> int:
        return self.pool.page_size

    @property
    def tail_free_slots(self) -> int:
        return len(self.pages) * self.page_size - self.length

    def snapshot(self) -> tuple:
        return (tuple(self.pages), self.length, self.released)

    def pages_needed(self, n: int) -> int:
        """Pages `reserve(n)` would take from the pool (new tail pages plus a copy-on-write)."""
        self._check_live()
        n = self._check_count(n)
        new = -(-(self.length + n) // self.page_size) - len(self.pages)
        return max(new, 0) + (1 if n and self._tail_is_shared() else 0)

    def slots(self, start: int, n: int) -> np.ndarray:
        """Slots (int64) of logical positions [start, start + n), all reserved already."""
        if not 0 <= start <= start + n <= self.length:
            raise ServingError("slot", f"positions [{start}, {start + n}) are not all reserved (length {self.length})")
        pos = np.arange(start, start + n, dtype=np.int64)
        table = np.asarray(self.pages, dtype=np.int64)
        return table[pos // self.page_size] * self.page_size + pos % self.page_size

    def reserve(self, n: int) -> np.ndarray:
        self._check_live()
        n = self._check_count(n)
        if self.max_tokens is not None and self.length + n > self.max_tokens:
            raise ServingError("capacity", f"appending {n} positions to {self.length} exceeds max_tokens={self.max_tokens}")
        fresh = self.pool.allocate(self.pages_needed(n))  # PoolExhausted: nothing changed yet
        if n and self._tail_is_shared():
            private = fresh.pop()
            tail = self.pages[-1]
            self.pool.copy_pages([tail], [private])
            self.pool.free([tail])
            self.pages[-1] = private
        self.pages.extend(fresh)
        start, self.length = self.length, self.length + n
        return self.slots(start, n)

    def append(self, keys, values) -> np.ndarray:
        """Writes n new positions into every layer; keys[l], values[l] are `[n, Hkv, D]`."""
        self._check_live()
        pool = self.pool
        if len(keys) != pool.num_layers or len(values) != pool.num_layers:
            raise ServingError("append_shape", f"append needs K and V for all {pool.num_layers} layers, "
                                               f"got {len(keys)} and {len(values)}")
        n = keys[0].shape[0] if pool.num_layers else 0
        for layer, rows in enumerate(list(keys) + list(values)):
            want = (n, pool.kv_heads, pool.head_dim)
            if tuple(rows.shape) != want:
                raise ServingError("append_shape", f"layer {layer % pool.num_layers} rows have shape "
                                                   f"{tuple(rows.shape)}, expected {want}")
            if rows.dtype != pool.dtype:
                raise ServingError("append_dtype", f"rows dtype {rows.dtype} differs from the pool's {pool.dtype}")
        slots = self.reserve(n)
        for layer in range(pool.num_layers):
            pool.write(layer, slots, keys[layer], values[layer])
        return slots

    def fork(self) -> PagedCache:
        self._check_live()
        self.pool.share(self.pages)
        child = PagedCache(self.pool, max_tokens=self.max_tokens)
        child.pages, child.length = list(self.pages), self.length
        return child

    def release(self) -> list[int]:
        """Drops this cache's reference to each page; returns the pages that became free."""
        if self.released:
            raise PageAlreadyFree("this cache was released already; its pages went back once")
        freed = self.pool.free(self.pages)
        self.pages, self.length, self.released = [], 0, True
        return freed

    def _tail_is_shared(self) -> bool:
        return self.length % self.page_size != 0 and self.pool.ref_count(self.pages[-1]) > 1

    def _check_live(self) -> None:
        if self.released:
            raise ServingError("released", "this paged cache was released; make a new one")

    @staticmethod
    def _check_count(n) -> int:
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise ServingError("append_shape", f"a position count must be an int >= 0, got {n!r}")
        return int(n)
