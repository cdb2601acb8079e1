"""`PagePool`: every layer's K and V pages in fixed, contiguous storage.

| symbol          | meaning                                              | type / shape                    |
|-----------------|------------------------------------------------------|---------------------------------|
| `keys(l)`       | layer l's key pages, the operator's `key_pages`      | page dtype `[P, Hkv, page_size, D]` |
| `values(l)`     | layer l's value pages                                | page dtype `[P, Hkv, page_size, D]` |
| `kv_options(l)` | the operator's `kv_dtype`, `k_scale`, `v_scale` for layer l (`{}` unquantized), and `kv_layout` for a packed pool | dict |
| `layout`        | None (the contract's rows) or `"amx_packed"` (below)  | str or None                     |
| page id p       | one page in every layer at once                      | int in `[0, P)`                 |
| slot            | `page * page_size + offset`, one position of a page  | int64                           |
| `bytes_per_page`| K and V of one page over all layers (token scales included) | int                      |
| `dtype`         | the rows written (and, unquantized, the pages)       | float32 / float16 / bfloat16    |

Quantized pools (`kv_dtype`, contract/kv_format.py) hold 8-bit codes; a write encodes
each element as `encode(x / s)` (impl/csrc/quantize.h: nearest code, ties to even,
saturating at the largest finite value; NaN -> the NaN code, int8 0), in place like an
unquantized write. The scale `s` by granularity (`scales=`):

| `scales`  | `k_scale`, `v_scale` at construction                     | the operator's scale (`kv_options`) |
|-----------|----------------------------------------------------------|-------------------------------------|
| `tensor`  | float > 0 (every layer) or `[num_layers]`; None: 1.0      | float32 `[]`                        |
| `head`    | `[Hkv]` (every layer) or `[num_layers, Hkv]`; None: 1.0   | float32 `[Hkv]`                     |
| `token`   | None: each write computes its rows' scales (max abs / max finite; 1.0 for a zero row, NaN for a row with NaN or inf) and stores them in place | float32 `[P, Hkv, page_size]` |

| page pool state              | codes                                    | token scale |
|------------------------------|------------------------------------------|-------------|
| unwritten (fill NaN) or freed with `poison_freed` | fp8: NaN code `0x7f`; int8 (no NaN): -128, which no write produces | NaN |
| fill 0.0                     | 0                                        | 1.0         |

So an unwritten fp8 slot reads NaN under any scale, an int8 one only with token scales
(a tensor or head scaled int8 pool has no value that shows the poison: -128 marks it in
the pool's bits, not in attention outputs).

`layout="amx_packed"` (bfloat16 pools, page_size and head_dim multiples of 32): each
head's `[page_size, head_dim]` slice holds its elements in the order the AMX tiles read
them (conformance/formats/kv.py, impl/csrc/packed_layout.h), written so by every write;
`paged_attention_with_metadata(..., **pool.kv_options(l))` reads it (the tile decode
then takes K and V from the pool without packing them on every call: bench/notes/vllm-peer.md,
"bf16 decode on AMX"). Page ids, slots, page copies and the allocator are unchanged; the
contract entry point `paged_attention` takes the row layout only.

The capacity is fixed at construction (`num_pages` or `capacity_bytes`); nothing grows.
Writes go through `pagecheck_kernels.write_slots` / `quantize_slots` / `write_scales`,
which take over the layer's buffer (MLX donation) and write only the new rows. For that
the pool must hold the only reference to a layer's arrays (pages and token scales) when
the write is evaluated: callers evaluate what they computed from `keys(l)` / `values(l)`
/ `kv_options(l)` before the next write into layer l (the scheduler's engines do, once per
step). Otherwise MLX copies the layer, which `pool_copies()` counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import pagecheck_kernels as _kernels

from contract import GRANULARITIES, KV_DTYPES, storage_dtype

from .allocator import PageAllocator, PoolStats
from .checked import KV_CODES
from .errors import ServingError
from .runtime import KERNEL_STREAM
from .validation import PACKED_MULTIPLE, _dtype_name

_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
_CODE_DTYPES = {"uint8": mx.uint8, "int8": mx.int8}


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
                 fill: float = math.nan, poison_freed: bool = False, kv_dtype: str | None = None,
                 scales: str = "tensor", k_scale=None, v_scale=None, layout: str | None = None):
        for name, v in (("num_layers", num_layers), ("kv_heads", kv_heads),
                        ("head_dim", head_dim), ("page_size", page_size)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ServingError("capacity", f"{name} must be an int >= 1, got {v!r}")
        if dtype not in _DTYPES:
            raise ServingError("append_dtype", f"pool dtype must be float32, float16 or bfloat16, got {dtype}")
        self.num_layers, self.kv_heads, self.head_dim, self.page_size = num_layers, kv_heads, head_dim, page_size
        self.dtype = dtype
        self.kv_dtype, self.granularity = _check_format(kv_dtype, scales, fill)
        self.layout = _check_layout(layout, dtype, kv_dtype, page_size, head_dim)
        # the write path's page order (impl/csrc/packed_layout.h PageOrder) for K and V
        self._orders = (1, 2) if self.layout else (0, 0)
        per_layer = [_layer_scales(name, x, self.granularity, num_layers, kv_heads)
                     for name, x in (("k_scale", k_scale), ("v_scale", v_scale))]
        self.page_dtype = dtype if kv_dtype is None else _CODE_DTYPES[storage_dtype(kv_dtype)]
        token_bytes = 4 if self.granularity == "token" else 0
        self.bytes_per_page = 2 * num_layers * kv_heads * page_size * (head_dim * self.page_dtype.size + token_bytes)
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
        code = fill if kv_dtype is None else (0 if fill == 0 else _poison_code(kv_dtype))
        # Pages that start on a cache line (aligned_full): MLX's own large buffers start 24
        # bytes into one, so each 64-byte load of a row spans two lines; a float32 decode
        # B 1 S 1024 ran 3% faster on aligned pages (AMD, 2 threads, in turns). Filled in
        # their own buffer: a copy of an mx.full held a second layer until it was freed,
        # and MLX's buffer cache kept it after.
        fill_value = mx.array(code, dtype=self.page_dtype)
        self._keys = [_kernels.aligned_full(shape, fill_value) for _ in range(num_layers)]
        self._values = [_kernels.aligned_full(shape, fill_value) for _ in range(num_layers)]
        # Token scales are pool state like the pages (written in place); tensor and head
        # scales are the same constant arrays for the pool's life.
        self._k_scales, self._v_scales = per_layer if self.granularity != "token" else (
            [mx.full(shape[:3], 1.0 if fill == 0 else math.nan, dtype=mx.float32) for _ in range(num_layers)]
            for _ in range(2))
        mx.eval(self._keys, self._values, self._k_scales, self._v_scales)
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

    def kv_options(self, layer: int) -> dict:
        """Keyword arguments of `impl.paged_attention` for layer l's pages: `kv_dtype`,
        `k_scale`, `v_scale` (float32 `[]`, `[Hkv]` or `[P, Hkv, page_size]`); `{}` for an
        unquantized pool, so `paged_attention(..., **pool.kv_options(l))` fits both."""
        layer = self._check_layer(layer)
        if self.kv_dtype is None:
            return {"kv_layout": self.layout} if self.layout else {}
        return dict(kv_dtype=self.kv_dtype, k_scale=self._k_scales[layer], v_scale=self._v_scales[layer])

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
        pages were allocated, shared or freed since. Rows have the pool's `dtype`; a
        quantized pool encodes them (module docstring) and, with token scales, stores
        each (token, KV head) row's scale at its slot.
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
        if self.kv_dtype is None:
            for arrays, rows, order in ((self._keys, keys, self._orders[0]), (self._values, values, self._orders[1])):
                write = lambda pages, r, o=order: _kernels.write_slots(pages, r, ids, o, stream=KERNEL_STREAM)  # noqa: E731
                self._replace(arrays, layer, write, rows)
            return
        self._quantize(self._keys, self._k_scales, layer, ids, keys)
        self._quantize(self._values, self._v_scales, layer, ids, values)

    def _quantize(self, pages: list, scales: list, layer: int, ids: mx.array, rows: mx.array) -> None:
        """Encodes rows into `pages[layer]` at the slots `ids`; with token scales, first
        computes each row's scale and stores it in `scales[layer]` (its own in-place
        primitive: one output per primitive, see pool_update.h)."""
        code = KV_CODES[self.kv_dtype]
        if self.granularity == "token":
            s = _kernels.row_scales(rows, code, stream=KERNEL_STREAM)
            self._replace(scales, layer, lambda old, r: _kernels.write_scales(old, r, ids, stream=KERNEL_STREAM), s)
        else:
            s = scales[layer]
        self._replace(pages, layer, lambda old, r: _kernels.quantize_slots(old, r, ids, s, code,
                                                                           stream=KERNEL_STREAM), rows)

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
        copy = lambda pages, _: _kernels.copy_pages(pages, s, d, stream=KERNEL_STREAM)  # noqa: E731
        # A page's token scales are part of it: a copy without them would decode the
        # copied codes with the destination's stale scales.
        arrays = [self._keys, self._values] + ([self._k_scales, self._v_scales] if self.granularity == "token" else [])
        for layer in range(self.num_layers):
            for per_layer in arrays:
                self._replace(per_layer, layer, copy, None)
        self.allocator.pages_copied += len(src)

    @staticmethod
    def _replace(arrays: list, layer: int, op, rows) -> None:
        """arrays[layer] = op(arrays[layer], rows), with the pool's own reference dropped
        before MLX evaluates the update, so the kernel can take the buffer over (see
        module docstring). Lazy: no host sync here."""
        old, arrays[layer] = arrays[layer], None
        arrays[layer] = op(old, rows)
        del old

    def _poison(self, pages) -> None:
        """The unwritten state (module docstring) in every slot of `pages`, every layer."""
        ps = self.page_size
        slots = [p * ps + o for p in pages for o in range(ps)]
        fill = math.nan if self.kv_dtype is None else _poison_code(self.kv_dtype)
        rows = mx.full((len(slots), self.kv_heads, self.head_dim), fill, dtype=self.page_dtype)
        slot_ids = mx.array(np.asarray(slots, dtype=np.int64))
        for layer in range(self.num_layers):
            for arrays, order in ((self._keys, self._orders[0]), (self._values, self._orders[1])):
                self._replace(arrays, layer, lambda pg, r, o=order: _kernels.write_slots(
                    pg, r, slot_ids, o, stream=KERNEL_STREAM), rows)
        if self.granularity == "token":
            nan = mx.full((len(slots), self.kv_heads), math.nan, dtype=mx.float32)
            write_nan = lambda sc, r: _kernels.write_scales(sc, r, slot_ids, stream=KERNEL_STREAM)  # noqa: E731
            for layer in range(self.num_layers):
                self._replace(self._k_scales, layer, write_nan, nan)
                self._replace(self._v_scales, layer, write_nan, nan)

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


def _check_layout(layout, dtype, kv_dtype, page_size: int, head_dim: int) -> str | None:
    """A pool's page layout (module docstring), or ServingError("kv_layout")."""
    if layout is None:
        return None
    if not isinstance(layout, str) or layout != "amx_packed":
        raise ServingError("kv_layout", f"layout must be None (rows) or 'amx_packed', got {layout!r}")
    if dtype != mx.bfloat16 or kv_dtype is not None:
        raise ServingError("kv_layout", f"an amx_packed pool holds bfloat16 pages, got {_dtype_name(dtype)}"
                                        + (f" as {kv_dtype} codes" if kv_dtype else ""))
    if page_size % PACKED_MULTIPLE or head_dim % PACKED_MULTIPLE:
        raise ServingError("kv_layout", f"an amx_packed pool needs page_size and head_dim multiples of "
                                        f"{PACKED_MULTIPLE}, got {page_size} and {head_dim}")
    return layout


def _poison_code(kv_dtype: str) -> int:
    """An unwritten slot's code: the NaN code 0x7f of both fp8 formats; int8 has no NaN,
    so -128, the one code the symmetric write path never produces."""
    return -128 if kv_dtype == "int8" else 0x7F


def _check_format(kv_dtype, scales, fill) -> tuple[str | None, str | None]:
    """(kv_dtype, granularity) of a pool, or ServingError: an unknown format or
    granularity, scales without a format, or a quantized pool's fill other than NaN
    (the poison) or 0.0."""
    if kv_dtype is not None and (not isinstance(kv_dtype, str) or kv_dtype not in KV_DTYPES):
        raise ServingError("kv_dtype", f"kv_dtype must be None or one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
    if not isinstance(scales, str) or scales not in GRANULARITIES:
        raise ServingError("kv_scale", f"scales must be one of {', '.join(GRANULARITIES)}, got {scales!r}")
    if kv_dtype is None:
        if scales != "tensor":
            raise ServingError("kv_scale", f"scales={scales!r} needs a kv_dtype (an unquantized pool has no scales)")
        return None, None
    if not (isinstance(fill, (int, float)) and (math.isnan(fill) or fill == 0)):
        raise ServingError("kv_dtype", f"a {kv_dtype} pool starts poisoned (fill NaN) or zero (fill 0.0), "
                                       f"got fill={fill!r}")
    return kv_dtype, scales


_SCALE_SHAPES = {"tensor": lambda layers, heads: ((), (layers,)),
                 "head": lambda layers, heads: ((heads,), (layers, heads))}


def _layer_scales(name: str, x, granularity: str | None, num_layers: int, kv_heads: int) -> list | None:
    """Per layer, the float32 mx array of a tensor or head scale given at construction
    (module docstring table), or ServingError("kv_scale"); None where the pool has no
    constant scales (unquantized, or token scales)."""
    if granularity is None or granularity == "token":
        if x is not None:
            why = "token scales are computed by the writes" if granularity else "an unquantized pool has no scales"
            raise ServingError("kv_scale", f"{name} given, but {why}")
        return None
    one, every = _SCALE_SHAPES[granularity](num_layers, kv_heads)
    if x is None:
        x = np.ones(one, dtype=np.float32)
    if isinstance(x, (mx.array, np.ndarray)) and _dtype_name(x.dtype) != "float32":
        raise ServingError("kv_scale", f"{name} must be float32, got {_dtype_name(x.dtype)}")
    try:
        arr = np.asarray(x)
        if arr.dtype.kind not in "iuf":  # bools, strings, objects: not a scale
            raise TypeError
        arr = arr.astype(np.float64)
    except (TypeError, ValueError):
        raise ServingError("kv_scale", f"{name} must be a number or an array of numbers, got {x!r}") from None
    if arr.shape not in (one, every):
        raise ServingError("kv_scale", f"{granularity} {name} must have shape {list(one)} (every layer) or "
                                       f"{list(every)}, got {list(arr.shape)}")
    with np.errstate(over="ignore"):  # a value past float32's range becomes inf: rejected below
        f32 = arr.astype(np.float32)
    if not (np.isfinite(f32).all() and (f32 > 0).all()):
        raise ServingError("kv_scale", f"{name} must be finite float32 values > 0, got {arr.ravel()[:4].tolist()}")
    f32 = np.broadcast_to(f32, every)
    return [mx.array(np.array(f32[layer], dtype=np.float32)) for layer in range(num_layers)]

