"""`PagePool`: every layer's K and V pages in fixed, contiguous storage.

| symbol          | meaning                                              | type / shape                    |
|-----------------|------------------------------------------------------|---------------------------------|
| `keys(l)`       | layer l's key pages, the operator's `key_pages`      | dtype `[P, Hkv, page_size, D]`  |
| `values(l)`     | layer l's value pages                                | dtype `[P, Hkv, page_size, D]`  |
| page id p       | one page in every layer at once                      | int in `[0, P)`                 |
| slot            | `page * page_size + offset`, one position of a page  | int64                           |
| `bytes_per_page`| K and V of one page over all layers                  | int                             |

The capacity is fixed at construction (`num_pages` or `capacity_bytes`); nothing grows.
Writes go through `pagecheck_kernels.write_slots`, which takes over the layer's buffer
(MLX donation) and writes only the new rows. For that the pool must hold the only
reference to a layer's arrays when the write is evaluated: callers evaluate what they
computed from `keys(l)` / `values(l)` before the next write into layer l (the scheduler's
engines do, once per step). Otherwise MLX copies the layer, which `pool_copies()` counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import pagecheck_kernels as _kernels

from .allocator import PageAllocator, PoolStats
from .errors import ServingError
from .runtime import KERNEL_STREAM

_DTYPES = (mx.float32, mx.float16, mx.bfloat16)


@dataclass(frozen=True, eq=False)
class Slots:
    """A validated slot list: host copy, device copy, and the allocator state it holds for."""

    host: np.ndarray
    device: mx.array
    allocator: PageAllocator   # the pool's, so a list checked against another pool is checked again
    version: int


def pool_copies() -> int:
    """Pool updates so far that had to copy a whole layer instead of writing in place."""
    return _kernels.pool_copies()


class PagePool:
    def __init__(self, *, num_layers: int, kv_heads: int, head_dim: int, page_size: int,
                 dtype=mx.float32, num_pages: int | None = None, capacity_bytes: int | None = None,
                 fill: float = math.nan, poison_freed: bool = False):
        for name, v in (("num_layers", num_layers), ("kv_heads", kv_heads),
                        ("head_dim", head_dim), ("page_size", page_size)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ServingError("capacity", f"{name} must be an int >= 1, got {v!r}")
        if dtype not in _DTYPES:
            raise ServingError("append_dtype", f"pool dtype must be float32, float16 or bfloat16, got {dtype}")
        self.num_layers, self.kv_heads, self.head_dim, self.page_size = num_layers, kv_heads, head_dim, page_size
        self.dtype = dtype
        self.bytes_per_page = 2 * num_layers * kv_heads * page_size * head_dim * dtype.size
        if (num_pages is None) == (capacity_bytes is None):
            raise ServingError("capacity", "give exactly one of num_pages and capacity_bytes")
        if num_pages is None:
            num_pages = capacity_bytes // self.bytes_per_page if isinstance(capacity_bytes, int) else 0
        if not isinstance(num_pages, int) or isinstance(num_pages, bool) or num_pages < 1:
            raise ServingError("capacity", f"the pool must hold at least one page, got num_pages={num_pages!r} "
                                           f"(capacity_bytes={capacity_bytes!r}, {self.bytes_per_page} bytes a page)")
        self.num_pages = num_pages
        self.fill = fill
        self.poison_freed = poison_freed
        self.allocator = PageAllocator(num_pages)
        shape = (num_pages, kv_heads, page_size, head_dim)
        self._keys = [mx.full(shape, fill, dtype=dtype) for _ in range(num_layers)]
        self._values = [mx.full(shape, fill, dtype=dtype) for _ in range(num_layers)]
        mx.eval(self._keys, self._values)
        # On 2 MiB pages where Linux allows (writes stay in place, so they stay there): a
        # decode jumps between scattered pages, and with 4 KiB pages each jump is a page
        # walk (B 4, S 32768, page 16, f32 from DRAM: 45.7 -> 41.8 ms).
        for layer in (*self._keys, *self._values):
            _kernels.huge_pages(layer)

    # -- storage -----------------------------------------------------------------------
    def keys(self, layer: int) -> mx.array:
        return self._keys[self._check_layer(layer)]

    def values(self, layer: int) -> mx.array:
        return self._values[self._check_layer(layer)]

    @property
    def capacity_bytes(self) -> int:
        return self.num_pages * self.bytes_per_page

    def stats(self) -> PoolStats:
        return self.allocator.stats()

    # -- pages (delegated; see PageAllocator) -------------------------------------------
    def allocate(self, n: int) -> list[int]:
        return self.allocator.allocate(n)

    def share(self, pages) -> None:
        self.allocator.share(pages)

    def free(self, pages) -> list[int]:
        freed = self.allocator.free(pages)
        if self.poison_freed and freed:
            self._poison(freed)
        return freed

    def ref_count(self, page: int) -> int:
        return self.allocator.ref_count(page)

    # -- writes ------------------------------------------------------------------------
    def prepare_slots(self, slots) -> Slots:
        """Validates a slot list once, for writes into several layers (see `write`)."""
        arr = self._check_slots(slots)
        return Slots(arr, mx.array(arr), self.allocator, self.allocator.version)

    def write(self, layer: int, slots, keys: mx.array, values: mx.array) -> None:
        """Writes keys[t], values[t] (`[T, Hkv, D]`) at `slots[t]` of layer `layer`.

        Every slot must lie in a live page held by one owner (a cache copies a shared
        page before writing into it) and appear once. Checked before anything is
        written; `slots` may be a `Slots` from `prepare_slots`, checked again only if
        pages were allocated, shared or freed since.
        """
        layer = self._check_layer(layer)
        if not isinstance(slots, Slots) or slots.allocator is not self.allocator \
                or slots.version != self.allocator.version:
            slots = self.prepare_slots(slots.host if isinstance(slots, Slots) else slots)
        for name, rows in (("keys", keys), ("values", values)):
            if not isinstance(rows, mx.array):
                raise ServingError("append_shape", f"{name} must be an mlx array, got {type(rows).__name__}")
            want = (len(slots.host), self.kv_heads, self.head_dim)
            if tuple(rows.shape) != want:
                raise ServingError("append_shape", f"{name} has shape {tuple(rows.shape)}, expected {want} "
                                                   "([tokens, kv_heads, head_dim], one row per slot)")
            if rows.dtype != self.dtype:
                raise ServingError("append_dtype", f"{name} dtype {rows.dtype} differs from the pool's {self.dtype}")
        if len(slots.host) == 0:
            return
        ids = slots.device
        self._update(layer, lambda pages, rows: _kernels.write_slots(pages, rows, ids, stream=KERNEL_STREAM), keys, values)

    def copy_pages(self, src, dst) -> None:
        """Copies page src[i] into dst[i] in every layer (the copy of copy-on-write)."""
        src = [self.allocator.check_page(p) for p in src]
        dst = [self.allocator.check_page(p) for p in dst]
        if len(src) != len(dst):
            raise ServingError("page_id", f"copy_pages got {len(src)} sources and {len(dst)} destinations")
        for p in src + dst:
            if not self.allocator.is_live(p):
                raise ServingError("slot", f"page {p} is free; copies go between live pages")
        for p in dst:
            if self.allocator.ref_count(p) > 1:
                raise ServingError("shared_write", f"page {p} is shared by {self.allocator.ref_count(p)} "
                                                   "holders; a copy may only overwrite a private page")
        if len(set(dst)) != len(dst) or set(src) & set(dst):
            raise ServingError("page_id", "copy_pages destinations must be distinct and not sources")
        if not src:
            return
        s, d = mx.array(src, dtype=mx.int32), mx.array(dst, dtype=mx.int32)
        for layer in range(self.num_layers):
            self._update(layer, lambda pages, _: _kernels.copy_pages(pages, s, d, stream=KERNEL_STREAM), None, None)
        self.allocator.pages_copied += len(src)

    def _update(self, layer, op, keys, values) -> None:
        # The pool drops its own reference before MLX evaluates the update, so the kernel
        # can take the buffer over (see module docstring). Lazy: no host sync here.
        k, self._keys[layer] = self._keys[layer], None
        self._keys[layer] = op(k, keys)
        del k
        v, self._values[layer] = self._values[layer], None
        self._values[layer] = op(v, values)
        del v

    def _poison(self, pages) -> None:
        ps = self.page_size
        slots = [p * ps + o for p in pages for o in range(ps)]
        rows = mx.full((len(slots), self.kv_heads, self.head_dim), math.nan, dtype=self.dtype)
        slot_ids = mx.array(np.asarray(slots, dtype=np.int64))
        for layer in range(self.num_layers):
            self._update(layer, lambda pg, r: _kernels.write_slots(pg, r, slot_ids, stream=KERNEL_STREAM), rows, rows)

    def _check_layer(self, layer) -> int:
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or not 0 <= layer < self.num_layers:
            raise ServingError("layer", f"layer {layer!r} is outside [0, {self.num_layers})")
        return int(layer)

    def _check_slots(self, slots) -> np.ndarray:
        arr = np.asarray(slots)
        if arr.ndim != 1 or not (arr.size == 0 or np.issubdtype(arr.dtype, np.integer)):
            raise ServingError("slot", f"slots must be a 1-D sequence of ints, got {arr.dtype} {arr.shape}")
        arr = arr.astype(np.int64)
        limit = self.num_pages * self.page_size
        bad = arr[(arr < 0) | (arr >= limit)]
        if bad.size:
            raise ServingError("slot", f"slot {int(bad[0])} is outside the pool [0, {limit})")
        if np.unique(arr).size != arr.size:
            raise ServingError("slot", "a slot appears twice in one write")
        for p in np.unique(arr // self.page_size).tolist():
            refs = self.allocator.ref_count(p)
            if refs == 0:
                raise ServingError("slot", f"page {p} is free: a write goes into an allocated page")
            if refs > 1:
                raise ServingError("shared_write", f"page {p} is shared by {refs} holders; copy it before writing")
        return arr
