"""Checks of the operator contract (REFERENCE.md section 1), split by cost.

`check_arrays` and `check_pipeline` look only at shapes, dtypes and Python values: no
host sync. `check_metadata_values` checks the values of `block_table` and
`context_lens` (negative or short contexts, tables too short, page ids outside the
pool) in one compiled pass over the arrays where they lie; `paged_attention` runs it
on every call. The serving path builds one `PagedMetadata` per scheduler step (a
checked, frozen snapshot with host copies) and reuses it for every layer.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import NamedTuple

import mlx.core as mx
import numpy as np
import pagecheck_kernels as _kernels

from contract import KV_DTYPES, ScorePipeline, granularity_of, storage_dtype

from .errors import ContractViolation

FLOAT_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
# A Python float: NumPy 2 would cast a Python float compared with np.float32's max to
# float32, warn of an overflow past it (an error under -W error), and compare inf.
F32_MAX = float(np.finfo(np.float32).max)


# Geometry and KernelOptions are made on every call: as NamedTuples (immutable too) they
# cost 0.25 us each to build, a frozen dataclass 0.9 us.
class Geometry(NamedTuple):
    """Sizes read off the arrays: batch, heads, query length, head dims, pool."""

    batch: int
    q_heads: int
    kv_heads: int
    query_len: int
    head_dim: int  # Dk: the query's and the key pages'
    num_pages: int
    page_size: int
    max_pages: int
    value_dim: int  # Dv: the value pages' and the output's


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("mlx.core.")


def _require_array(name, x):
    if not isinstance(x, mx.array):
        raise ContractViolation("type", f"{name} must be an mlx.core.array, got {type(x).__name__}")


def _require_rank(name, x, rank, layout):
    if x.ndim != rank:
        raise ContractViolation("rank", f"{name} must be {rank}-D {layout}; got shape {tuple(x.shape)}")


def _int_arg(name, value, clause):
    if isinstance(value, bool):
        raise ContractViolation(clause, f"{name} must be an int, got bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ContractViolation(clause, f"{name} must be an int, got {type(value).__name__} {value!r}") from None


def check_kv_dtype(kv_dtype) -> str | None:
    """A call's `kv_dtype` (contract/kv_format.py): None or one of its formats."""
    if kv_dtype is not None and (not isinstance(kv_dtype, str) or kv_dtype not in KV_DTYPES):
        raise ContractViolation("kv_dtype", f"kv_dtype must be None or one of {', '.join(KV_DTYPES)}, "
                                            f"got {kv_dtype!r}")
    return kv_dtype


def check_arrays(query, key_pages, value_pages, block_table, context_lens, page_size,
                 kv_dtype: str | None = None) -> Geometry:
    """Shape and dtype rules; raises ContractViolation naming the argument. With a
    `kv_dtype` the pools hold its codes (uint8 for fp8, int8), else the query's dtype."""
    for name, x in (("query", query), ("key_pages", key_pages), ("value_pages", value_pages),
                    ("block_table", block_table), ("context_lens", context_lens)):
        _require_array(name, x)
    _require_rank("query", query, 4, "[B, Hq, L, D]")
    _require_rank("key_pages", key_pages, 4, "[P, Hkv, page_size, Dk]")
    _require_rank("value_pages", value_pages, 4, "[P, Hkv, page_size, Dv]")
    _require_rank("block_table", block_table, 2, "[B, max_pages]")
    _require_rank("context_lens", context_lens, 1, "[B]")
    if query.dtype not in FLOAT_DTYPES:
        raise ContractViolation("dtype", f"query dtype {_dtype_name(query.dtype)} is not supported (float32, float16, bfloat16)")
    kv_dtype = check_kv_dtype(kv_dtype)
    for name, x in (("key_pages", key_pages), ("value_pages", value_pages)):
        if kv_dtype is not None:
            if _dtype_name(x.dtype) != storage_dtype(kv_dtype):
                raise ContractViolation("kv_dtype", f"{name} dtype {_dtype_name(x.dtype)}: kv_dtype {kv_dtype} "
                                                    f"pages hold {storage_dtype(kv_dtype)} codes")
        elif x.dtype != query.dtype:
            raise ContractViolation("dtype", f"{name} dtype {_dtype_name(x.dtype)} differs from query dtype "
                                             f"{_dtype_name(query.dtype)}")
    # Metadata dtypes (int32) are checked where the values are read: check_metadata_dtype.
    B, Hq, L, D = query.shape
    P, Hkv, slots, Dk = key_pages.shape
    if tuple(value_pages.shape[:3]) != tuple(key_pages.shape[:3]) or value_pages.shape[3] < 1:
        raise ContractViolation("value_shape", f"value_pages shape {tuple(value_pages.shape)} differs from "
                                f"key_pages shape {tuple(key_pages.shape)} outside the head dim "
                                f"([P, Hkv, page_size] must agree; only Dv may differ from Dk)")
    if Dk != D or D < 1:
        raise ContractViolation("shape", f"head dim differs: query D={D}, key_pages D={Dk}")
    for name, x in (("block_table", block_table), ("context_lens", context_lens)):
        if x.shape[0] != B:
            raise ContractViolation("shape", f"{name} has {x.shape[0]} rows but query has B={B} requests")
    if Hkv < 1 or Hq % Hkv != 0:
        raise ContractViolation("heads", f"Hq={Hq} is not a multiple of Hkv={Hkv}")
    page_size = _int_arg("page_size", page_size, "page_size")
    if page_size < 1:
        raise ContractViolation("page_size", f"page_size must be >= 1, got {page_size}")
    if page_size != slots:
        raise ContractViolation("page_size", f"page_size={page_size} disagrees with key_pages.shape[2]={slots}")
    return Geometry(B, Hq, Hkv, L, D, P, page_size, block_table.shape[1], value_pages.shape[3])


def check_options(head_dim: int, scale, mask, window) -> tuple[float, bool, int]:
    """Returns (scale, causal, window) with window 0 meaning none."""
    if scale is None:
        scale = head_dim ** -0.5
    elif isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)):
        raise ContractViolation("scale", f"scale must be a float, got {type(scale).__name__} {scale!r}")
    scale = float(scale)
    if not math.isfinite(scale) or abs(scale) > F32_MAX:
        raise ContractViolation("scale", f"scale must be a finite float32 value, got {scale!r}")
    if not (mask is None or (isinstance(mask, str) and mask == "causal")):
        raise ContractViolation("mask", f"mask must be 'causal' or None, got {mask!r}")
    causal = mask is not None
    if window is None:
        return scale, causal, 0
    window = _int_arg("window", window, "window")
    if window < 1:
        raise ContractViolation("window", f"window must be >= 1 or None, got {window}")
    if not causal:
        raise ContractViolation("window", f"window={window} needs mask='causal' (got mask=None)")
    if window > np.iinfo(np.int32).max:
        raise ContractViolation("window", f"window={window} does not fit in int32")
    return scale, causal, window


class KernelOptions(NamedTuple):
    """A checked `ScorePipeline` as the kernel takes it: 0 / None mean "off"."""

    scale: float
    causal: bool
    window: int  # 0: none
    softcap: float  # 0: none
    alibi_slopes: mx.array | None  # float32 [Hq]
    sinks: mx.array | None  # float32 [Hq]
    return_lse: bool
    kv_dtype: str | None  # None: pages in the query's dtype
    k_scale: mx.array | None  # float32 [], [Hkv] or [P, Hkv, ps] with a kv_dtype
    v_scale: mx.array | None


def _head_vector(name: str, x, q_heads: int) -> mx.array | None:
    """alibi_slopes / sinks: float32 [Hq]. Values are not read (no host sync): like the
    query's, they are the caller's data (a sink of -inf is no sink)."""
    if x is None:
        return None
    if isinstance(x, np.ndarray):
        if x.dtype != np.float32:
            raise ContractViolation(name, f"{name} must be float32, got {x.dtype}")
        x = mx.array(x)
    elif not isinstance(x, mx.array):
        raise ContractViolation(name, f"{name} must be an mlx.core.array (float32 [Hq]), got {type(x).__name__}")
    if x.dtype != mx.float32:
        raise ContractViolation(name, f"{name} must be float32, got {_dtype_name(x.dtype)}")
    if tuple(x.shape) != (q_heads,):
        raise ContractViolation(name, f"{name} must have shape [Hq] = ({q_heads},), got {tuple(x.shape)}")
    return x


def _kv_scale(name: str, x, geom: Geometry) -> mx.array:
    """k_scale / v_scale: a float > 0 (per tensor) or a float32 array [], [Hkv] or
    [P, Hkv, ps]; None is 1.0. An array's values are not read (no host sync)."""
    if x is None:
        x = 1.0
    if isinstance(x, (int, float, np.floating, np.integer)) and not isinstance(x, bool):
        value = float(x)
        if not (math.isfinite(value) and 0.0 < value <= F32_MAX):
            raise ContractViolation("kv_scale", f"{name} must be a finite float32 value > 0, got {x!r}")
        return mx.array(value, dtype=mx.float32)
    if isinstance(x, np.ndarray):
        if x.dtype != np.float32:
            raise ContractViolation("kv_scale", f"{name} must be float32, got {x.dtype}")
        x = mx.array(x)
    elif not isinstance(x, mx.array):
        raise ContractViolation("kv_scale", f"{name} must be a float or a float32 mlx.core.array, "
                                            f"got {type(x).__name__}")
    if x.dtype != mx.float32:
        raise ContractViolation("kv_scale", f"{name} must be float32, got {_dtype_name(x.dtype)}")
    if granularity_of(x.shape, num_pages=geom.num_pages, kv_heads=geom.kv_heads, page_size=geom.page_size) is None:
        raise ContractViolation("kv_scale", f"{name} shape {tuple(x.shape)} is none of [] (per tensor), "
                                f"[Hkv] = ({geom.kv_heads},) (per head) or [P, Hkv, page_size] = "
                                f"({geom.num_pages}, {geom.kv_heads}, {geom.page_size}) (per token)")
    return x


def check_pipeline(geom: Geometry, pipeline: ScorePipeline) -> KernelOptions:
    """Every option of the call (contract/pipeline.py) against the contract."""
    scale, causal, window = check_options(geom.head_dim, pipeline.scale, pipeline.mask, pipeline.window)
    softcap = pipeline.softcap
    if softcap is None:
        softcap = 0.0
    else:
        if isinstance(softcap, bool) or not isinstance(softcap, (int, float, np.floating, np.integer)):
            raise ContractViolation("softcap", f"softcap must be a float > 0 or None, got {type(softcap).__name__} "
                                               f"{softcap!r}")
        softcap = float(softcap)
        if not (math.isfinite(softcap) and 0.0 < softcap <= F32_MAX):
            raise ContractViolation("softcap", f"softcap must be a finite float32 value > 0, got {softcap!r}")
    if not isinstance(pipeline.return_lse, (bool, np.bool_)):
        raise ContractViolation("lse", f"return_lse must be True or False, got {pipeline.return_lse!r}")
    kv_dtype = check_kv_dtype(pipeline.kv_dtype)
    if kv_dtype is None:
        for name in ("k_scale", "v_scale"):
            if getattr(pipeline, name) is not None:
                raise ContractViolation("kv_scale", f"{name} is given but kv_dtype is None: scales belong to "
                                                    "quantized pages")
        k_scale = v_scale = None
    else:
        k_scale = _kv_scale("k_scale", pipeline.k_scale, geom)
        v_scale = _kv_scale("v_scale", pipeline.v_scale, geom)
    return KernelOptions(scale, causal, window, softcap,
                         _head_vector("alibi_slopes", pipeline.alibi_slopes, geom.q_heads),
                         _head_vector("sinks", pipeline.sinks, geom.q_heads), bool(pipeline.return_lse),
                         kv_dtype, k_scale, v_scale)


# The page orders of the serving path: None, the contract's rows, or the tile-packed order
# (impl/csrc/packed_layout.h) that the AMX tiles read without packing.
KV_LAYOUTS = (None, "amx_packed")
PACKED_MULTIPLE = 32  # page_size and head dim of a packed pool: whole 32-key V units, whole tiles


def check_kv_layout(geom: Geometry, kv_layout, dtype, kv_dtype) -> bool:
    """`kv_layout` of a serving call against its arrays; True for the packed order."""
    if kv_layout is None:
        return False
    if not isinstance(kv_layout, str) or kv_layout not in KV_LAYOUTS:
        raise ContractViolation("kv_layout", f"kv_layout must be None (rows) or 'amx_packed', got {kv_layout!r}")
    if dtype != mx.bfloat16 or kv_dtype is not None:
        raise ContractViolation("kv_layout", f"amx_packed pages hold bfloat16 (the tiles' operands), got "
                                             f"{_dtype_name(dtype)} pages" + (f" of {kv_dtype} codes" if kv_dtype else ""))
    if geom.page_size % PACKED_MULTIPLE or geom.head_dim % PACKED_MULTIPLE or geom.value_dim != geom.head_dim:
        raise ContractViolation("kv_layout", f"amx_packed needs page_size and head dim multiples of "
                                f"{PACKED_MULTIPLE} and Dv = Dk, got page_size {geom.page_size}, Dk "
                                f"{geom.head_dim}, Dv {geom.value_dim}")
    return True


# pagecheck_kernels.check_metadata's rule codes (impl/csrc/metadata_check.h), 0 = none
METADATA_RULES = (None, "context_negative", "context_short", "table_short", "page_id")


def check_metadata_values(block_table: mx.array, context_lens: mx.array, *, page_size: int, num_pages: int,
                          query_len: int) -> None:
    """Value rules on the int32 metadata; raises naming the request / page.

    One compiled pass over the arrays where they lie (no host copy, no Python loop):
    the first offending request is named, with its first broken rule in the order
    context_negative, context_short, table_short, page_id (at its first bad column among
    those it reads). Request b reads column j when j * page_size < ctx, and needs more
    than max_pages pages when ctx > max_pages * page_size."""
    code, b, ctx, i, page = _kernels.check_metadata(block_table, context_lens, page_size, num_pages, query_len)
    rule = METADATA_RULES[code]
    if rule is None:
        return
    if rule == "context_negative":
        raise ContractViolation(rule, f"context_lens[{b}] = {ctx} is negative")
    if rule == "context_short":
        raise ContractViolation(rule, f"context_lens[{b}] = {ctx} is shorter than the query "
                                f"length L={query_len}: a non-empty request holds its L new positions")
    if rule == "table_short":
        raise ContractViolation(rule, f"request {b} needs {-(-ctx // page_size)} pages (context {ctx}, "
                                f"page_size {page_size}) but block_table rows hold max_pages={block_table.shape[1]}")
    raise ContractViolation(rule, f"block_table[{b}, {i}] = {page} is outside the pool "
                            f"[0, {num_pages}) (request {b} reads logical page {i})")


def check_metadata_dtype(name, x):
    """`block_table` / `context_lens`: an int32 MLX or NumPy array, returned as given."""
    if isinstance(x, mx.array):
        if x.dtype != mx.int32:
            raise ContractViolation("metadata_dtype", f"{name} must be int32, got {_dtype_name(x.dtype)}")
        return x
    if isinstance(x, np.ndarray):
        if x.dtype != np.int32:
            raise ContractViolation("metadata_dtype", f"{name} must be int32, got {x.dtype}")
        return x
    raise ContractViolation("type", f"{name} must be an mlx.core.array or numpy int32 array, got {type(x).__name__}")


@dataclass(frozen=True, eq=False)
class PagedMetadata:
    """Block table and context lengths whose values were checked once.

    Build it with `PagedMetadata.build` (one host read at most; none from numpy
    input) and pass it to `paged_attention_with_metadata` for every layer of a step:
    each call then checks only shapes, never values.
    """

    block_table: mx.array
    context_lens: mx.array
    block_table_host: np.ndarray
    context_lens_host: np.ndarray
    page_size: int
    num_pages: int
    query_len: int
    # signature -> the checks' result of a call that passed with this metadata (impl/checked.py)
    checked: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def batch(self) -> int:
        return self.block_table_host.shape[0]

    @classmethod
    def build(cls, block_table, context_lens, *, page_size: int, num_pages: int, query_len: int) -> PagedMetadata:
        bt = check_metadata_dtype("block_table", block_table)
        cl = check_metadata_dtype("context_lens", context_lens)
        if bt.ndim != 2 or cl.ndim != 1 or bt.shape[0] != cl.shape[0]:
            raise ContractViolation("shape", f"block_table {tuple(bt.shape)} and context_lens {tuple(cl.shape)} "
                                    "must be [B, max_pages] and [B]")
        page_size = _int_arg("page_size", page_size, "page_size")
        if page_size < 1:
            raise ContractViolation("page_size", f"page_size must be >= 1, got {page_size}")
        # The snapshot first (one host copy of MLX or NumPy input, one MLX array of it),
        # then the check on it: the host copies and the kernel's arrays hold what was
        # checked, whatever the caller's arrays become later (an MLX array's in-place
        # update rebinds the very object it was given as).
        bt_host, cl_host = np.array(bt, copy=True), np.array(cl, copy=True)
        bt, cl = mx.array(bt_host), mx.array(cl_host)
        check_metadata_values(bt, cl, page_size=page_size, num_pages=num_pages, query_len=query_len)
        bt_host.setflags(write=False)
        cl_host.setflags(write=False)
        return cls(bt, cl, bt_host, cl_host, page_size, int(num_pages), int(query_len))

    def check_matches(self, geom: Geometry) -> None:
        """Shapes of this call against what the values were checked for."""
        expected = (self.batch, self.query_len, self.num_pages, self.page_size)
        actual = (geom.batch, geom.query_len, geom.num_pages, geom.page_size)
        if expected != actual:
            raise ContractViolation("metadata_stale", f"metadata was validated for (B, L, P, page_size) = "
                                    f"{expected} but this call has {actual}")
