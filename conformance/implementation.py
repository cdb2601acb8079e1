"""The implementation under test: the built-in kernel, or any callable named `MODULE:ATTR`.

The callable must take and return `mlx.core.array` with the REFERENCE.md section 1
signature (and the contract-v2 keywords of section 1b it declares: a call with
`return_lse=True` returns `(out, lse)`; quantized pools as contract/kv_format.py says).
`Implementation` wraps it with its declared capabilities
(conformance/capabilities.py) and the few helpers checks need to stay
implementation-neutral: skip a call outside the declaration, compare two outputs
bitwise or under the tolerance rule, set the worker count.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import mlx.core as mx
import pytest

from contract import GRANULARITIES, KV_DTYPES, ScorePipeline

from .capabilities import FEATURE_KEYS, Capabilities, feature_reason

BUILTIN = "impl:paged_attention"


class UsageError(Exception):
    """A bad `--impl` value or capability declaration (shown without a traceback)."""


@dataclass(frozen=True)
class Implementation:
    name: str
    fn: object
    caps: Capabilities
    builtin: bool = False

    def __call__(self, *args, **kwargs):
        """Calls the implementation; skips the check when the call uses a feature the
        implementation does not declare (the reason names the feature)."""
        reason = self.unsupported(*args, **kwargs)
        if reason:
            pytest.skip(f"not declared by {self.name}: {reason}")
        return self.fn(*args, **kwargs)

    def unsupported(self, query, key_pages, value_pages, block_table, context_lens, page_size,
                    **options) -> str | None:
        """Why this call is outside the declaration, or None. The call is read as its
        `ScorePipeline` (contract/pipeline.py) and the value pool's head dim."""
        if not isinstance(query, mx.array) or query.ndim != 4:
            return None  # a malformed call is a rejection check, never skipped here
        try:
            pipeline = ScorePipeline.of(options)
        except TypeError:
            return None  # an unknown keyword: the kernel's own TypeError, not a skip
        return self.caps.unsupported(dtype=_dtype(query), head_dim=query.shape[-1], page_size=page_size,
                                     query_len=query.shape[2], pipeline=pipeline,
                                     value_head_dim=_value_dim(query, key_pages, value_pages),
                                     pool=_pool(key_pages))

    def supports(self, case) -> bool:
        return self.unsupported(*case.args(), **case.kwargs()) is None

    def require(self, capability: str) -> None:
        """Skips the calling check unless the capability is declared."""
        if not getattr(self.caps, capability):
            what = feature_reason([capability]) if capability in FEATURE_KEYS else \
                f"{capability} (declare it in pagecheck_capabilities)"
            pytest.skip(f"not declared by {self.name}: {what}")

    def require_case(self, case) -> None:
        """Skips the calling check when `case` uses what the declaration rules out, even
        where the check calls `attention.fn` directly (a rejection of a bad soft-cap is
        no check for a kernel without soft-cap)."""
        reason = self.unsupported(*case.args(), **case.kwargs())
        if reason:
            pytest.skip(f"not declared by {self.name}: {reason}")

    def packed(self, mixed):
        """Runs a batch of mixed query lengths (fixtures/mixed.py) as one packed call;
        skips unless the implementation takes varlen queries. Returns `[T, Hq, D]`."""
        if not hasattr(self.fn, "packed"):
            pytest.skip(f"not declared by {self.name}: mixed query lengths in one batch need "
                        f"query_packing='varlen' (the padded form gives every request the same L)")
        reason = self.caps.unsupported(dtype=_dtype(mixed.query), head_dim=mixed.query.shape[-1],
                                       page_size=mixed.page_size, query_len=mixed.max_query_len,
                                       pipeline=ScorePipeline.of(mixed.kwargs()),
                                       value_head_dim=_value_dim(mixed.query, *mixed.args()[2:4]),
                                       pool=_pool(mixed.args()[2]))
        if reason:
            pytest.skip(f"not declared by {self.name}: {reason}")
        out = self.fn.packed(*mixed.args(), **mixed.kwargs())
        mx.eval(*[x for x in (out if isinstance(out, tuple) else (out,)) if isinstance(x, mx.array)])
        return out

    def set_num_threads(self, n: int) -> None:
        self.require("bitwise_threads")
        self.caps.set_num_threads(n)


def _dtype(x) -> str:
    return str(x.dtype).removeprefix("mlx.core.")


def _value_dim(query, key_pages, value_pages) -> int | None:
    """The value pool's head dim Dv where the call's Dk is well defined (query and key
    pages agree); None for a malformed call, which is a rejection check, never a skip."""
    pools = all(isinstance(x, mx.array) and x.ndim == 4 for x in (key_pages, value_pages))
    if not pools or key_pages.shape[-1] != query.shape[-1]:
        return None
    return value_pages.shape[-1]


def _pool(key_pages) -> tuple | None:
    """The key pool's shape `(P, Hkv, ps, Dk)` (what tells a scale's granularity), or None
    for a malformed pool."""
    return tuple(key_pages.shape) if isinstance(key_pages, mx.array) and key_pages.ndim == 4 else None


def builtin() -> Implementation:
    import impl

    # extra_memory 0: the kernel reads the pools in place and allocates only its output.
    # It computes the whole contract v2 (REFERENCE.md 1b), every KV format at every granularity.
    caps = Capabilities(bitwise_batch=True, bitwise_threads=True, set_num_threads=impl.set_num_threads,
                        error_types=(impl.ContractViolation,), extra_memory=0.0, softcap=True, alibi=True,
                        sinks=True, lse=True, value_head_dim=True, kv_dtypes=frozenset(KV_DTYPES),
                        kv_scales=frozenset(GRANULARITIES))
    return Implementation("pagecheck built-in (impl.paged_attention)", impl.paged_attention, caps, builtin=True)


def load(spec: str | None) -> Implementation:
    """`MODULE:ATTR` (ATTR may be dotted) -> Implementation; None or the built-in's name
    gives the built-in. Raises UsageError with the reason on anything else."""
    if spec is None or spec == BUILTIN:
        return builtin()
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"--impl {spec!r}: expected MODULE:ATTR, e.g. mykernels.paged:paged_attention")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as e:
        raise UsageError(f"--impl {spec!r}: cannot import module {module_name!r}: {e} "
                         f"(it is imported with the normal sys.path; set PYTHONPATH)") from None
    except Exception as e:  # the module itself failed while importing
        raise UsageError(f"--impl {spec!r}: importing {module_name!r} raised {type(e).__name__}: {e}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            public = sorted(n for n in dir(obj) if not n.startswith("_"))[:12]
            raise UsageError(f"--impl {spec!r}: {module_name!r} has no attribute {attr!r} "
                             f"(some it has: {', '.join(public) or 'none'})")
        obj = getattr(obj, part)
    if not callable(obj):
        raise UsageError(f"--impl {spec!r}: {attr!r} is a {type(obj).__name__}, not a callable")
    import impl

    if obj is impl.paged_attention:
        return builtin()
    try:
        declared = getattr(obj, "pagecheck_capabilities", None)
        caps = Capabilities.declared(declared)
        if caps.converted and not getattr(obj, "pagecheck_contract_form", False):
            from .bridges import from_mlx  # an MLX kernel in a foreign format: convert each call

            obj = from_mlx(obj)
            caps = Capabilities.declared(obj.pagecheck_capabilities)
    except ValueError as e:
        raise UsageError(f"--impl {spec!r}: bad pagecheck_capabilities: {e}") from None
    return Implementation(spec, obj, caps)


def assert_same_output(impl: Implementation, out, want, case, what: str) -> None:
    """Two outputs of the same computation: equal bits when the implementation declares
    `bitwise_batch`, else each within the tolerance rule of the float64 oracle on `case`."""
    from fixtures import bits
    from oracles.compare import compare

    if impl.caps.bitwise_batch:
        parts = lambda x: x if isinstance(x, tuple) else (x,)  # noqa: E731 - (out, lse) with return_lse
        assert len(parts(out)) == len(parts(want)), f"{what}: {len(parts(out))} results, expected {len(parts(want))}"
        for name, o, w in zip(("output", "lse"), parts(out), parts(want)):
            assert bits(o) == bits(w), f"{what}: {name} bits differ (declared bitwise_batch)"
        return
    for label, o in (("first", want), ("second", out)):
        failures = compare(o, case.args(), case.kwargs()).failures()
        assert not failures, f"{what}: {label} output: {failures}"
