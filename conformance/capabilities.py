"""What an implementation under test declares it supports.

An implementation may carry an attribute `pagecheck_capabilities` (a dict, so a kernel
author need not import pagecheck). Every key is optional; an unknown key is a usage error
(a typo must not silently widen or narrow the checks).

| key                 | meaning                                                      | default (nothing declared) |
|---------------------|--------------------------------------------------------------|----------------------------|
| `dtypes`            | query dtypes it computes: subset of float32/float16/bfloat16 | all three                  |
| `head_dims`         | head dims it computes                                        | any                        |
| `page_sizes`        | page sizes it computes                                       | any                        |
| `block_multiple`    | page sizes must be multiples of this (vLLM CPU: 16)          | 1                          |
| `prefill`           | L > 1 query rows per request                                 | True                       |
| `window`            | causal sliding window                                        | True                       |
| `unmasked`          | `mask=None`                                                  | True                       |
| `validates_input`   | raises on every bad input of the contract's rejection list   | True                       |
| `error_types`       | exception classes that count as a contract error             | (ValueError, TypeError)    |
| `bitwise_batch`     | output bits independent of the batch, the slot, unread data and the prefill/decode split | False |
| `bitwise_threads`   | output bits independent of the worker count (needs `set_num_threads`) | False             |
| `set_num_threads`   | callable(n): sets the worker count                           | None                       |
| `framework`         | what the kernel takes: `mlx`, `numpy`, `torch` (set by the bridges) | `mlx`               |
| `device`            | `cpu` or `cuda` (torch bridge)                               | `cpu`                      |
| `layout`            | KV page layout (conformance/formats/kv.py: `hnd`, `nhd`, `kv_hnd`, `kv_nhd`, `kv_last`, `vllm_split`, `amx_packed`) | `hnd` (pagecheck's) |
| `page_table`        | `padded` (block_table + seq_lens) or `csr` (FlashInfer's kv_indptr / kv_indices / kv_last_page_len) | `padded` |
| `query_packing`     | `padded` `[B, Hq, L, D]` or `varlen` `[T, Hq, D]` + `cu_seqlens_q` | `padded`             |
| `window_convention` | `count` (w keys: pagecheck, vLLM, HF), `flash` (FlashAttention's `(w - 1, 0)`), `flashinfer` (`window_left = w - 1`) | `count` |
| `extra_memory`      | what one call may allocate beyond its inputs, in multiples of the KV pools' bytes (a float64 copy of bf16 pools: 4) | 4.0 |
| `widens_to`         | the dtype a bridge hands the kernel instead of the query's (declared widening), or None | None |
| `softcap`           | contract v2: `softcap=c` (`s = c * tanh(s / c)` on the scaled score) | False              |
| `alibi`             | contract v2: `alibi_slopes` float32 `[Hq]` (`s_j += slope_h * (j - p)` after the cap) | False |
| `sinks`             | contract v2: `sinks` float32 `[Hq]` (a logit in the softmax's denominator only) | False      |
| `lse`               | contract v2: `return_lse=True` returns `(out, lse)`, lse float32 `[B, Hq, L]` (natural log, `-inf` for an empty slot) | False |
| `value_head_dim`    | contract v2: value pages with a head dim Dv != Dk (output `[..., Dv]`) | False                  |
| `lse_convention`    | how its lse is written (conformance/formats/conventions.py): `natural` or `base2` (FlashInfer) | `natural` |
| `empty_lse`         | the lse of an empty row: `-inf` or `+inf` (FlashAttention 2)  | `-inf`                     |
| `alibi_convention`  | how it applies the slopes: `position` (pagecheck), `context_end` (vLLM CUDA), `abs_distance` (FlashAttention 2), `bias_before_cap` (FlashInfer) | `position` |
| `kv_dtypes`         | quantized KV pages it reads (contract/kv_format.py): subset of `float8_e4m3fn`, `float8_e5m2`, `int8` | none (empty) |
| `kv_scales`         | scale granularities it takes, for K and V alike: subset of `tensor` (`[]` or a float), `head` (`[Hkv]`), `token` (`[P, Hkv, ps]` at the physical slot) | `tensor` only |
| `kv_dtype_names`    | the kernel's name of each format, passed as its `kv_dtype` (vLLM CUDA: `{"float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2"}`) | pagecheck's names |

A kernel that declares any of `layout`, `page_table`, `query_packing` or
`window_convention` (or comes through a bridge that does) is called with the keyword
arguments of its native format (conformance/formats); one that declares none takes the
contract's own signature. The convention keys (`lse_convention`, `empty_lse`,
`alibi_convention`) keep the signature; the bridge converts the kernel's lse back.

A check a declaration rules out is skipped with the reason (and counted in the report);
an undeclared implementation runs the whole first contract except the bitwise and thread
checks, and none of the contract-v2 features: a kernel is never failed for lacking one
it does not declare. The reason of such a skip names the feature and the key, e.g.
`sinks (declare sinks=True in pagecheck_capabilities)` (`feature_reason`; the report
counts them per feature with `features_in`).

Quantized KV pages are declared per format and per scale granularity. A kernel that
declares no `kv_dtypes` is never called with a quantized pool (nor with a scale, nor a
bad `kv_dtype` to reject: quantized KV is a feature like sinks). `kv_scales` defaults to
`tensor` alone, the one granularity every system with fp8 pages takes (vLLM, FlashInfer,
FlashAttention 3); a kernel taking per-head or per-token scales says so, rather than be
failed on them for not saying it takes only one. The skip reason names the format (and
the granularity), e.g. `KV format float8_e5m2 (declare kv_dtypes=[..., 'float8_e5m2'] in
pagecheck_capabilities)` or `KV format int8 with v_scale per token (declare
kv_scales=[..., 'token'] in pagecheck_capabilities)` (`kv_reason`; the report counts them
per format with `kv_formats_in`). `kv_dtype_names` is a convention key: the call keeps
its signature, the bridge renames the value.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields

from contract import GRANULARITIES, KV_DTYPES, ScorePipeline

ALL_DTYPES = frozenset({"float32", "float16", "bfloat16"})
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
# key -> its allowed values (the format keys; conformance/formats implements each one)
CHOICES = {
    "framework": ("mlx", "numpy", "torch"),
    "device": ("cpu", "cuda"),
    "layout": ("hnd", "nhd", "kv_hnd", "kv_nhd", "kv_last", "vllm_split", "amx_packed"),
    "page_table": ("padded", "csr"),
    "query_packing": ("padded", "varlen"),
    "window_convention": ("count", "flash", "flashinfer"),
    "lse_convention": ("natural", "base2"),
    "empty_lse": ("-inf", "+inf"),
    "alibi_convention": ("position", "context_end", "abs_distance", "bias_before_cap"),
}
FORMAT_KEYS = ("layout", "page_table", "query_packing", "window_convention")
CONVENTION_KEYS = ("lse_convention", "empty_lse", "alibi_convention")
# quantized KV (contract/kv_format.py): the formats and the granularities a kernel may declare
KV_KEYS = {"kv_dtypes": tuple(KV_DTYPES), "kv_scales": GRANULARITIES}
DEFAULT_KV_SCALES = frozenset({"tensor"})
# a scale or an unknown kv_dtype on a kernel declaring no format (a rejection it need not make)
NO_KV_REASON = "quantized KV (declare kv_dtypes in pagecheck_capabilities)"
# contract-v2 features (keys of contract.pipeline.FEATURES) and Dv != Dk: each a bool key
FEATURE_KEYS = ("softcap", "alibi", "sinks", "lse", "value_head_dim")
_BOOLS = ("prefill", "window", "unmasked", "validates_input", "bitwise_batch", "bitwise_threads", *FEATURE_KEYS)
_DECLARE = re.compile(r"declare ((?:\w+=True(?:, )?)+) in pagecheck_capabilities")
_KV_FORMAT = re.compile(r"KV format (\w+)(?: with ((?:[kv]_scale per \w+(?:, )?)+))? \(declare kv_(dtypes|scales)=")


def feature_reason(features, detail: str = "") -> str:
    """The skip reason of a call using undeclared contract-v2 `features` (FEATURE_KEYS),
    e.g. `sinks (declare sinks=True in pagecheck_capabilities)`."""
    features = tuple(features)
    declare = ", ".join(f"{f}=True" for f in features)
    return f"{', '.join(features)} ({detail + '; ' if detail else ''}declare {declare} in pagecheck_capabilities)"


def features_in(reason: str) -> tuple[str, ...]:
    """The undeclared features a skip reason names (the inverse of feature_reason)."""
    m = _DECLARE.search(str(reason))
    if not m:
        return ()
    named = [part.removesuffix("=True") for part in m.group(1).split(", ") if part]
    return tuple(f for f in FEATURE_KEYS if f in named)


def kv_reason(kv_dtype, scales=()) -> str:
    """The skip reason of a quantized call outside the declaration: its format
    `kv_dtype` undeclared (no `scales`), or its format declared and the granularities
    `scales` ((option, granularity) pairs, e.g. `("v_scale", "token")`) not, e.g.
    `KV format int8 with v_scale per token (declare kv_scales=[..., 'token'] in pagecheck_capabilities)`."""
    if not scales:
        return f"KV format {kv_dtype} (declare kv_dtypes=[..., {kv_dtype!r}] in pagecheck_capabilities)"
    used = ", ".join(f"{option} per {g}" for option, g in scales)
    missing = ", ".join(repr(g) for g in dict.fromkeys(g for _, g in scales))
    return f"KV format {kv_dtype} with {used} (declare kv_scales=[..., {missing}] in pagecheck_capabilities)"


def kv_formats_in(reason: str) -> tuple[str, str] | None:
    """(format, `kv_dtypes` or `kv_scales`) of a skip reason naming an undeclared KV
    format or granularity (the inverse of kv_reason), or None."""
    m = _KV_FORMAT.search(str(reason))
    if not m:
        return None
    return m.group(1), f"kv_{m.group(3)}"


def _kv_set(key: str, value) -> frozenset:
    """A declared `kv_dtypes` / `kv_scales`: a collection of names among KV_KEYS[key]."""
    allowed = KV_KEYS[key]
    if isinstance(value, str) or not isinstance(value, (list, tuple, set, frozenset)):
        raise ValueError(f"capability {key} must be a list of names among {', '.join(allowed)}, got {value!r}")
    unknown = [v for v in value if v not in allowed]
    if unknown:
        raise ValueError(f"capability {key}: unknown {unknown[0]!r}; known: {', '.join(allowed)}")
    return frozenset(value)


def _kv_names(value) -> tuple:
    """A declared `kv_dtype_names` (pagecheck's format name -> the kernel's, a non-empty
    str) as sorted (format, name) pairs."""
    if not isinstance(value, dict):
        raise ValueError(f"capability kv_dtype_names must be a dict (pagecheck's format -> the kernel's name), "
                         f"got {value!r}")
    for fmt, name in value.items():
        if fmt not in KV_DTYPES:
            raise ValueError(f"capability kv_dtype_names: unknown format {fmt!r}; known: {', '.join(KV_DTYPES)}")
        if not isinstance(name, str) or not name:
            raise ValueError(f"capability kv_dtype_names: the name of {fmt} must be a non-empty str, got {name!r}")
    return tuple(sorted(value.items()))


def split_x(dtype: str) -> int:
    """vLLM CUDA's key-cache split: x elements make 16 bytes (8 for 16-bit types, 4 for float32)."""
    return 16 // ITEMSIZE[dtype]


@dataclass(frozen=True)
class Capabilities:
    dtypes: frozenset = ALL_DTYPES
    head_dims: frozenset | None = None
    page_sizes: frozenset | None = None
    block_multiple: int = 1
    prefill: bool = True
    window: bool = True
    unmasked: bool = True
    validates_input: bool = True
    error_types: tuple = (ValueError, TypeError)
    bitwise_batch: bool = False
    bitwise_threads: bool = False
    set_num_threads: object = None
    framework: str = "mlx"
    device: str = "cpu"
    layout: str = "hnd"
    page_table: str = "padded"
    query_packing: str = "padded"
    window_convention: str = "count"
    extra_memory: float = 4.0
    widens_to: str | None = None
    softcap: bool = False
    alibi: bool = False
    sinks: bool = False
    lse: bool = False
    value_head_dim: bool = False
    lse_convention: str = "natural"
    empty_lse: str = "-inf"
    alibi_convention: str = "position"
    kv_dtypes: frozenset = frozenset()
    kv_scales: frozenset = DEFAULT_KV_SCALES
    kv_dtype_names: tuple = ()  # (format, the kernel's name) pairs; a tuple keeps Capabilities hashable
    native_call: bool = False  # set by `declared`: some format key was given

    @classmethod
    def declared(cls, spec: dict | None) -> Capabilities:
        """From a `pagecheck_capabilities` dict; raises ValueError naming a bad key or value."""
        if spec is None:
            return cls()
        if not isinstance(spec, dict):
            raise ValueError(f"pagecheck_capabilities must be a dict, got {type(spec).__name__}")
        known = {f.name for f in fields(cls)} - {"native_call"}
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ValueError(f"unknown capability {unknown[0]!r}; known: {', '.join(sorted(known))}")
        values = dict(spec)
        for key in ("dtypes", "head_dims", "page_sizes"):
            if values.get(key) is not None:
                values[key] = frozenset(values[key])
        bad = sorted(set(values.get("dtypes", ALL_DTYPES)) - ALL_DTYPES)
        if bad:
            raise ValueError(f"capability dtypes: {bad} not among {sorted(ALL_DTYPES)}")
        if not values.get("dtypes", ALL_DTYPES):
            raise ValueError("capability dtypes is empty: declare at least one dtype")
        for key in KV_KEYS:
            if key in values:
                values[key] = _kv_set(key, values[key])
        if not values.get("kv_scales", DEFAULT_KV_SCALES):
            raise ValueError("capability kv_scales is empty: declare at least one granularity (tensor, head, token)")
        if "kv_dtype_names" in values:
            values["kv_dtype_names"] = _kv_names(values["kv_dtype_names"])
        for key in ("head_dims", "page_sizes"):
            v = values.get(key)
            if v is not None and (not v or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1
                                                   for n in v)):
                raise ValueError(f"capability {key} must be a non-empty set of ints >= 1, got {sorted(v, key=str)}")
        if "error_types" in values:
            types = tuple(values["error_types"]) if isinstance(values["error_types"], (list, tuple)) \
                else (values["error_types"],)
            if not types or not all(isinstance(t, type) and issubclass(t, Exception) for t in types):
                raise ValueError("capability error_types must be exception classes")
            values["error_types"] = types
        for key in _BOOLS:
            if key in values and not isinstance(values[key], bool):
                raise ValueError(f"capability {key} must be True or False, got {values[key]!r}")
        for key, allowed in CHOICES.items():
            if key in values and values[key] not in allowed:
                raise ValueError(f"capability {key} must be one of {', '.join(allowed)}, got {values[key]!r}")
        m = values.get("block_multiple", 1)
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"capability block_multiple must be an int >= 1, got {m!r}")
        e = values.get("extra_memory", 4.0)
        if isinstance(e, bool) or not isinstance(e, (int, float)) or not e >= 0:
            raise ValueError(f"capability extra_memory must be a number >= 0, got {e!r}")
        values["extra_memory"] = float(e)
        if values.get("widens_to") not in (None, "float32", "float64"):
            raise ValueError(f"capability widens_to must be None, float32 or float64, got {values['widens_to']!r}")
        caps = cls(**values, native_call=any(k in spec for k in FORMAT_KEYS))
        if caps.bitwise_threads and not callable(caps.set_num_threads):
            raise ValueError("capability bitwise_threads needs a callable set_num_threads")
        if caps.page_sizes is not None and not caps.allowed_page_sizes(caps.page_sizes):
            raise ValueError(f"capability page_sizes {sorted(caps.page_sizes)}: none is a multiple of "
                             f"block_multiple {caps.block_multiple}")
        return caps

    def allowed_page_sizes(self, sizes) -> list[int]:
        """The sizes among `sizes` this declaration computes, ascending."""
        return sorted(s for s in sizes if s % self.block_multiple == 0
                      and (self.page_sizes is None or s in self.page_sizes))

    def unsupported_shape(self, *, dtype: str, head_dim: int, page_size: int) -> str | None:
        """Why a (dtype, head dim, page size) is outside the declaration, or None."""
        if dtype not in self.dtypes:
            return f"dtype {dtype} (declared dtypes: {', '.join(sorted(self.dtypes))})"
        if self.head_dims is not None and head_dim not in self.head_dims:
            return f"head dim {head_dim} (declared head_dims: {sorted(self.head_dims)})"
        if self.page_sizes is not None and page_size not in self.page_sizes:
            return f"page size {page_size} (declared page_sizes: {sorted(self.page_sizes)})"
        if page_size % self.block_multiple:
            return f"page size {page_size} (declared block_multiple: {self.block_multiple})"
        if self.layout == "vllm_split" and head_dim % split_x(dtype):
            return (f"head dim {head_dim} (layout vllm_split splits D into chunks of x = {split_x(dtype)} "
                    f"for {dtype})")
        if self.layout == "amx_packed" and (head_dim % 32 or page_size % 32):
            return f"head dim {head_dim}, page size {page_size} (layout amx_packed: multiples of 32)"
        return None

    @property
    def converted(self) -> bool:
        """Whether a bridge stands between the contract and the kernel: a native format,
        a convention other than pagecheck's own (the lse to convert back), or its own
        names of the KV formats."""
        return (self.native_call or any(getattr(self, k) != CHOICES[k][0] for k in CONVENTION_KEYS)
                or bool(self.kv_dtype_names))

    def kv_dtype_name(self, kv_dtype):
        """The kernel's name of a format (`kv_dtype_names`), else `kv_dtype` as given."""
        return dict(self.kv_dtype_names).get(kv_dtype, kv_dtype) if isinstance(kv_dtype, str) else kv_dtype

    def features(self) -> tuple[str, ...]:
        """The contract-v2 features declared (FEATURE_KEYS order)."""
        return tuple(f for f in FEATURE_KEYS if getattr(self, f))

    def unsupported(self, *, dtype: str, head_dim: int, page_size: int, query_len: int,
                    pipeline: ScorePipeline, value_head_dim: int | None = None,
                    pool: tuple | None = None) -> str | None:
        """Why a call (its shapes, its score pipeline `pipeline` with its KV format, its
        value pages' head dim, its key pool's shape `pool` `(P, Hkv, ps, ...)`, which
        tells a scale's granularity) is outside the declaration, or None. The one place
        a call is held against the declaration: Implementation and the bridges ask here."""
        reason = self.unsupported_shape(dtype=dtype, head_dim=head_dim, page_size=page_size)
        if reason:
            return reason
        if query_len > 1 and not self.prefill:
            return f"L = {query_len} > 1 (declared prefill=False)"
        if pipeline.mask is None and not self.unmasked:
            return "mask=None (declared unmasked=False)"
        if pipeline.window is not None and not self.window:
            return "a sliding window (declared window=False)"
        missing = [f for f in pipeline.features() if not getattr(self, f)]
        details = []
        if value_head_dim is not None and value_head_dim != head_dim and not self.value_head_dim:
            missing.append("value_head_dim")
            details.append(f"Dv = {value_head_dim} != Dk = {head_dim}")
        reasons = [feature_reason(missing, "; ".join(details))] if missing else []
        kv = self.unsupported_kv(pipeline, pool)
        if kv:
            reasons.append(kv)
        return "; ".join(reasons) or None

    def unsupported_kv(self, pipeline: ScorePipeline, pool: tuple | None = None) -> str | None:
        """Why the call's KV format (`pipeline.kv`) is outside the declaration, or None.
        A call naming no format but passing a scale (a rejection check) counts as using
        quantized KV; an unknown format or a malformed scale is left to the kernel to
        reject when it declares some format, and skipped when it declares none."""
        kv = pipeline.kv
        if not kv.quantized and kv.k_scale is None and kv.v_scale is None:
            return None
        fmt = kv.dtype if isinstance(kv.dtype, str) and kv.dtype in KV_DTYPES else None
        if not self.kv_dtypes:
            return kv_reason(fmt) if fmt else NO_KV_REASON
        if fmt is None:
            return None  # a rejection check (kv_dtype unknown, or a scale without one)
        if fmt not in self.kv_dtypes:
            return kv_reason(fmt)
        if pool is not None and len(pool) >= 3:
            grains = kv.granularities(num_pages=pool[0], kv_heads=pool[1], page_size=pool[2])
        else:
            grains = tuple(_granularity_by_rank(s) for s in (kv.k_scale, kv.v_scale))
        missing = [(option, g) for option, g in zip(("k_scale", "v_scale"), grains)
                   if g is not None and g not in self.kv_scales]
        return kv_reason(fmt, missing) if missing else None

    def kv_formats(self) -> tuple[str, ...]:
        """The KV formats declared, in contract.KV_DTYPES order."""
        return tuple(f for f in KV_DTYPES if f in self.kv_dtypes)

    def summary(self) -> dict:
        """JSON-friendly view for the report."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in KV_KEYS:
                v = [x for x in KV_KEYS[f.name] if x in v]  # the contract's order, not the alphabet's
            elif isinstance(v, frozenset):
                v = sorted(v)
            elif f.name == "error_types":
                v = [t.__name__ for t in v]
            elif f.name == "set_num_threads":
                v = v is not None
            elif f.name == "kv_dtype_names":
                v = dict(v)
            out[f.name] = v
        return out


def _granularity_by_rank(scale) -> str | None:
    """A scale's granularity where the pool's shape is unknown: by its rank alone."""
    if scale is None or isinstance(scale, (int, float)):
        return "tensor"
    return {0: "tensor", 1: "head", 3: "token"}.get(len(getattr(scale, "shape", ())))
