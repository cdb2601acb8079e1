"""The checks of a serving call, remembered on its `PagedMetadata` by everything they read.

`paged_attention_with_metadata` and `paged_attention_now` check every call's arrays and
options (`check_arrays`, `check_pipeline`, `check_kv_layout`,
`PagedMetadata.check_matches`) before the kernel reads anything. In Python that is ~5 us
a call, and the kernel after it runs ~3 us slower than after no Python at all (checks
then kernel 33.0 us against 5.1 + 24.8 apart; a plain Python loop between calls costs no
such extra, so presumably the checks' objects displace the kernel's data in the core's
caches): B 1, S 128, f32, 2 threads, 33 us a call against a 25 us kernel, where vLLM's
whole call takes 23 us. A model step calls every layer with the same metadata, options
and array shapes, so every layer after the first repeats the same checks with the same
verdict.

Those checks read the three arrays' types, shapes and dtypes, the options' types and
values (of an array option, its shape and dtype, never its values: no host sync) and the
metadata, which is frozen. `signature` is all of that as one hashable key; a call whose
signature equals one that passed passes too, with the same checked options, except
that the kernel reads the array options this call passes (`Checked.with_arrays`; the
memo keeps none of a caller's arrays, which may be pool state written in place). A
call that fails is never remembered, so a bad call raises as it always did. Calls a key
cannot describe exactly (an argument that is not an `mx.array`, a NumPy or other option
object, a scale of zero: `0.0 == -0.0`) are checked every time.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx
import pagecheck_kernels as _kernels

from contract import ScorePipeline
from contract.pipeline import OPTIONS

from .validation import Geometry, KernelOptions, PagedMetadata, check_arrays, check_kv_layout, check_pipeline

# kv_dtype -> the kernel's element code (paged_attention.h KvCode)
KV_CODES = {None: 0, "float8_e4m3fn": 1, "float8_e5m2": 2, "int8": 3}
# KernelOptions fields that hold the caller's own arrays (check_pipeline returns an
# mx.array option as given).
ARRAY_OPTIONS = ("alibi_slopes", "sinks", "k_scale", "v_scale")
_ARRAY_SLOTS = tuple(OPTIONS.index(name) for name in ARRAY_OPTIONS)  # their places in a call's options
MEMO_LIMIT = 32  # signatures per metadata: a step's calls have a few (one per layer kind)
# Signatures the contract entry point remembers, process-wide (it has no metadata object to
# hold them): its block table's shape moves with the batch and the pages, so the oldest
# is dropped for a new one rather than the memo freezing on the first calls it saw.
CONTRACT_LIMIT = 64
_contract_memo: dict = {}


def kernel_options(opts: KernelOptions, packed: bool) -> tuple:
    """The kernel entries' arguments after the pool and its metadata, in their order."""
    return (opts.scale, opts.causal, opts.window, opts.softcap, opts.alibi_slopes, opts.sinks, KV_CODES[opts.kv_dtype],
            opts.k_scale, opts.v_scale, packed)


class Checked(NamedTuple):
    """What the checks of a call give the kernel call: `args`, its arguments after the
    pool and the metadata (kernel_options), made once per remembered signature rather
    than from `opts` on every call (0.3 us of a small decode)."""

    opts: KernelOptions
    packed: bool
    arrays: tuple = ()  # (KernelOptions field, place in the options) of each option given as an mx.array
    args: tuple = ()

    @classmethod
    def of(cls, opts: KernelOptions, packed: bool, arrays: tuple = ()) -> Checked:
        return cls(opts, packed, arrays, kernel_options(opts, packed))

    def with_arrays(self, options: tuple, keep: bool = True) -> Checked:
        """The same checked call reading the array options of `options` (a call of the same
        signature: arrays of the same shapes and dtypes in the same places); with
        keep=False, reading none (None in their place), as the memo holds it: a caller's
        array may be pool state (a layer's token scales), written in place only while
        nothing else refers to it. A call without array options is returned as it is
        (most calls: 0.9 -> 0.05 us)."""
        if not self.arrays:
            return self
        return Checked.of(self.opts._replace(**{name: options[i] if keep else None for name, i in self.arrays}),
                          self.packed, self.arrays)


# signature(query, key_pages, value_pages, options) -> tuple | None: everything the checks
# read of a call as one hashable key, None where no key states it exactly. `options`:
# ScorePipeline's fields in order, then kv_layout. Built in C++ (impl/csrc/call_key.h):
# the three arrays' shapes and dtypes and every option's type in one bytes object, then
# each option by value (an mx.array option by its shape and dtype in the bytes, never its
# values); True, 1 and 1.0 are equal values told apart by their types; None for a scale
# of 0.0 (0.0 == -0.0), for an array argument that is not exactly an mx.array and for an
# option of any type but None, bool, int, float, str and mx.array. The same key in Python
# (tuples of shapes, dtypes and types) took 0.7 us of a 12 us B 1, S 128 decode, and its
# hash in the memo's look-up 0.2 more; this one 0.1 and 0.13 (AMD Zen 5).
signature = _kernels.call_key


def check_call(query, key_pages, value_pages, metadata: PagedMetadata, options: tuple) -> Checked:
    """Every check of a serving call (raises ContractViolation on the first broken rule);
    what they give the kernel call."""
    pipeline = ScorePipeline(*options[:-1])
    geom = check_arrays(query, key_pages, value_pages, metadata.block_table, metadata.context_lens,
                        metadata.page_size, pipeline.kv_dtype)
    opts = check_pipeline(geom, pipeline)
    arrays = tuple((name, i) for name, i in zip(ARRAY_OPTIONS, _ARRAY_SLOTS) if type(options[i]) is mx.array)
    checked = Checked.of(opts, check_kv_layout(geom, options[-1], query.dtype, opts.kv_dtype), arrays)
    metadata.check_matches(geom)
    return checked


def checked_call(query, key_pages, value_pages, metadata: PagedMetadata, options: tuple) -> Checked:
    """The call's checks: remembered from an earlier call with the same signature and
    metadata, else run (check_call) and remembered when they pass."""
    key = signature(query, key_pages, value_pages, options)
    memo = metadata.checked if key is not None and isinstance(metadata, PagedMetadata) else None
    if memo is not None:
        hit = memo.get(key)
        if hit is not None:
            return hit.with_arrays(options)
    checked = check_call(query, key_pages, value_pages, metadata, options)
    if memo is not None and len(memo) < MEMO_LIMIT:
        memo[key] = checked.with_arrays(options, keep=False)
    return checked


def contract_signature(query, key_pages, value_pages, block_table, context_lens, page_size,
                       options: tuple) -> tuple | None:
    """`signature` of a `paged_attention` call (options: ScorePipeline's fields) with what
    its checks read of the metadata: both arrays' types, shapes and dtypes, page_size's
    type and value (never the arrays' values); None where no key states it exactly."""
    key = signature(query, key_pages, value_pages, (*options, None))
    if (key is None or type(block_table) is not mx.array or type(context_lens) is not mx.array
            or type(page_size) is not int):
        return None
    return key, block_table.shape, block_table.dtype, context_lens.shape, context_lens.dtype, page_size


def checked_contract_call(query, key_pages, value_pages, block_table, context_lens, page_size,
                          options: tuple) -> tuple[Geometry, KernelOptions]:
    """(geometry, kernel options) of a `paged_attention` call: `check_arrays` and
    `check_pipeline`, remembered by `contract_signature` when they pass (the oldest of
    CONTRACT_LIMIT dropped first). The metadata's dtypes and values are not among them:
    the caller checks those on every call."""
    key = contract_signature(query, key_pages, value_pages, block_table, context_lens, page_size, options)
    hit = _contract_memo.get(key)  # no call is remembered under None
    if hit is not None:
        return hit[0], hit[1].with_arrays(options).opts
    pipeline = ScorePipeline(*options)
    geom = check_arrays(query, key_pages, value_pages, block_table, context_lens, page_size, pipeline.kv_dtype)
    opts = check_pipeline(geom, pipeline)
    if key is not None:
        arrays = tuple((name, i) for name, i in zip(ARRAY_OPTIONS, _ARRAY_SLOTS) if type(options[i]) is mx.array)
        if len(_contract_memo) >= CONTRACT_LIMIT:
            _contract_memo.pop(next(iter(_contract_memo), None), None)
        _contract_memo[key] = (geom, Checked.of(opts, False, arrays).with_arrays(options, keep=False))
    return geom, opts
