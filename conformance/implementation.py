"""The implementation under test: the built-in kernel, or any callable named `MODULE:ATTR`.

The callable must take and return `mlx.core.array` with the REFERENCE.md section 1
signature. `Implementation` wraps it with its declared capabilities
(conformance/capabilities.py) and the few helpers checks need to stay
implementation-neutral: skip a call outside the declaration, compare two outputs
bitwise or under the tolerance rule, set the worker count.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import mlx.core as mx
import pytest

from .capabilities import Capabilities

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

    def unsupported(self, query, key_pages, value_pages, block_table, context_lens, page_size, *,
                    scale=None, mask="causal", window=None) -> str | None:
        if not isinstance(query, mx.array) or query.ndim != 4:
            return None  # a malformed call is a rejection check, never skipped here
        dtype = str(query.dtype).removeprefix("mlx.core.")
        return self.caps.unsupported(dtype=dtype, head_dim=query.shape[-1], page_size=page_size,
                                     query_len=query.shape[2], mask=mask, window=window)

    def supports(self, case) -> bool:
        return self.unsupported(*case.args(), **case.kwargs()) is None

    def require(self, capability: str) -> None:
        """Skips the calling check unless the capability is declared."""
        if not getattr(self.caps, capability):
            pytest.skip(f"not declared by {self.name}: {capability} (declare it in pagecheck_capabilities)")

    def packed(self, mixed):
        """Runs a batch of mixed query lengths (fixtures/mixed.py) as one packed call;
        skips unless the implementation takes varlen queries. Returns `[T, Hq, D]`."""
        if not hasattr(self.fn, "packed"):
            pytest.skip(f"not declared by {self.name}: mixed query lengths in one batch need "
                        f"query_packing='varlen' (the padded form gives every request the same L)")
        dtype = str(mixed.query.dtype).removeprefix("mlx.core.")
        reason = self.caps.unsupported(dtype=dtype, head_dim=mixed.query.shape[-1], page_size=mixed.page_size,
                                       query_len=mixed.max_query_len, mask=mixed.mask, window=mixed.window)
        if reason:
            pytest.skip(f"not declared by {self.name}: {reason}")
        out = self.fn.packed(*mixed.args(), **mixed.kwargs())
        mx.eval(out)
        return out

    def set_num_threads(self, n: int) -> None:
        self.require("bitwise_threads")
        self.caps.set_num_threads(n)


def builtin() -> Implementation:
    import impl

    # extra_memory 0: the kernel reads the pools in place and allocates only its output.
    caps = Capabilities(bitwise_batch=True, bitwise_threads=True, set_num_threads=impl.set_num_threads,
                        error_types=(impl.ContractViolation,), extra_memory=0.0)
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
        if caps.native_call and not getattr(obj, "pagecheck_contract_form", False):
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
        assert bits(out) == bits(want), f"{what}: bits differ (declared bitwise_batch)"
        return
    for label, o in (("first", want), ("second", out)):
        failures = compare(o, case.args(), case.kwargs()).failures()
        assert not failures, f"{what}: {label} output: {failures}"
