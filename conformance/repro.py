"""A failed check becomes a standalone reproduction: `<report dir>/repro/<check>.py`.

| piece        | what it does                                                              |
|--------------|---------------------------------------------------------------------------|
| `CALLS`      | the last call the implementation under test received in the running check (the plugin wraps `attention.fn` with `recording`, which both `attention(...)` and the rejection checks' `attention.fn(...)` reach, and clears it at each check's setup) |
| `recording`  | wraps a callable so its calls are recorded (the plugin wraps `attention.fn`)   |
| `write`      | one failed check's call -> `<name>.npz` (the arrays, the contract-v2 ones `alibi_slopes` / `sinks` and the quantized pools' codes with their `k_scale` / `v_scale` included, `kv_dtype` restated in the call, the float64 oracle's answer, the tolerance rule's allowance; with `return_lse` the oracle's lse and its allowance too) and `<name>.py` (conformance/repro_script.py: loads them, calls the kernel, says how far off out and lse are; exit 1 while it fails) |

Why the last call: a check's failing assertion follows the call it judges, and
hypothesis replays the shrunk failing example last, so the last call is the shrunk one.
A check that compares two calls (batch, thread or schedule invariance, a scrambled
table against the clean one) is reproduced by its last call against the oracle only;
the script says so, with the check's statement.

A call the contract rejects (impl/validation.py says why) makes a rejection repro: the
script passes when the kernel raises one of its declared error types with a message,
and says what happened instead. Arrays over `MAX_BYTES` (the 4 GiB fixture) are not
written; the report line says so.
"""

from __future__ import annotations

import hashlib
import inspect
import math
import re
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from contract import ScorePipeline
from contract.pipeline import OPTIONS

from .repro_script import render

MAX_BYTES = 64 * 2 ** 20
DEFAULT_ERRORS = ("ValueError", "TypeError")
# checks pointing at these clauses compare the outputs of two calls
COMPARES_CALLS = {"inv2": "the output of one table order against another",
                  "inv3": "a request on shared pages against the same request alone",
                  "inv6": "a request's bits in the batch against its bits alone (or in another batch)",
                  "inv7": "the bits under one worker count against another",
                  "inv8": "a prefill row's bits against the one-token decode at its position",
                  "inv9": "the output with garbage in unread slots or entries against the clean one"}
# declared keys that make `load` convert the kernel's calls (formats and conventions)
NATIVE_KEYS = ("layout", "page_table", "query_packing", "window_convention", "lse_convention", "empty_lse",
               "alibi_convention", "kv_dtype_names")


def _contract(query, key_pages, value_pages, block_table, context_lens, page_size, *,
              scale=None, mask="causal", window=None, softcap=None, alibi_slopes=None, sinks=None,
              return_lse=False, kv_dtype=None, k_scale=None, v_scale=None):
    """The contract's signature (REFERENCE.md sections 1 and 1b), for naming recorded arguments."""


SIGNATURE = inspect.signature(_contract)


@dataclass(frozen=True)
class Call:
    args: tuple
    kwargs: dict
    unwritable: str = ""  # set for a call a script cannot restate in the contract's form


class CallLog:
    """The last call of the running check."""

    def __init__(self):
        self.last: Call | None = None

    def clear(self) -> None:
        self.last = None

    def record(self, args: tuple, kwargs: dict, unwritable: str = "") -> None:
        self.last = Call(tuple(args), dict(kwargs), unwritable)


CALLS = CallLog()


def recording(fn):
    """`fn` with its calls recorded in CALLS (attributes such as pagecheck_capabilities kept)."""
    import functools

    @functools.wraps(fn)
    def recorded(*args, **kwargs):
        CALLS.record(args, kwargs)
        return fn(*args, **kwargs)

    if callable(getattr(fn, "packed", None)):  # mixed query lengths as one varlen call
        @functools.wraps(fn.packed)
        def packed(*args, **kwargs):
            CALLS.record(args, kwargs, unwritable="a packed varlen call (mixed query lengths)")
            return fn.packed(*args, **kwargs)

        recorded.packed = packed
    return recorded


def file_name(nodeid: str) -> str:
    """A safe file stem for a pytest node id: `tests/test_x.py::test_y[a-b]` ->
    `test_x__test_y_a-b`; long ids are cut and get a hash of the whole id."""
    path, _, rest = nodeid.partition("::")
    stem = Path(path).stem + ("__" + rest if rest else "")
    stem = re.sub(r"[^A-Za-z0-9_-]+", "_", stem.replace("::", "__")).strip("_") or "check"
    if len(stem) > 100:
        stem = stem[:90].rstrip("_") + "_" + hashlib.sha1(nodeid.encode()).hexdigest()[:8]
    return stem


@dataclass
class Repro:
    path: str = ""  # the script, relative to the report directory ("repro/<name>.py"), when written
    note: str = ""  # why none was written, or what it can and cannot show


def _size(x) -> int:
    if isinstance(x, mx.array):
        return x.size * max(x.dtype.size, 4)
    if isinstance(x, np.ndarray):
        return x.nbytes
    return 0


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


class _Unwritable(Exception):
    pass


def _literal(v) -> str:
    if v is None or isinstance(v, (bool, str)):
        return repr(v)
    if isinstance(v, np.generic):
        return f"np.{type(v).__name__}({_literal(v.item())})"
    if isinstance(v, int):
        return repr(v)
    if isinstance(v, float):
        return repr(v) if math.isfinite(v) else f"float({str(v)!r})"
    raise _Unwritable(f"an argument of type {type(v).__name__}")


def _named(call: Call) -> list[tuple[str | None, str, object]]:
    """(keyword or None for positional, variable name, value) per argument."""
    try:
        SIGNATURE.bind(*call.args, **call.kwargs)
        positional = list(SIGNATURE.parameters)[:len(call.args)]
    except TypeError:
        positional = [f"arg{i}" for i in range(len(call.args))]
    out = [(None, name, v) for name, v in zip(positional, call.args)]
    out += [(k, k, v) for k, v in call.kwargs.items()]
    return out


def contract_violation(call: Call) -> str | None:
    """Why the contract rejects this call ("[clause] message"), or None for a valid call
    (the contract's checks as impl/validation.py states them)."""
    from impl.errors import ContractViolation
    from impl.validation import PagedMetadata, check_arrays, check_pipeline

    try:
        bound = SIGNATURE.bind(*call.args, **call.kwargs)
    except TypeError as e:
        return f"[signature] {e}"
    a = {**{k: p.default for k, p in SIGNATURE.parameters.items()}, **bound.arguments}
    try:
        geom = check_arrays(a["query"], a["key_pages"], a["value_pages"], a["block_table"], a["context_lens"],
                            a["page_size"], a["kv_dtype"])
        check_pipeline(geom, ScorePipeline.of({k: a[k] for k in OPTIONS}))
        PagedMetadata.build(a["block_table"], a["context_lens"], page_size=geom.page_size,
                            num_pages=geom.num_pages, query_len=geom.query_len)
    except ContractViolation as e:
        return f"[{e.clause}] {e}"
    return None


def _oracle(call: Call) -> dict:
    """The float64 oracle's answer and the tolerance rule's allowance for this call:
    `expected`, `allowed` and, with return_lse, `expected_lse`, `allowed_lse` (the LSE
    rule of oracles/tolerance.py)."""
    from oracles.compare import reference

    bound = SIGNATURE.bind(*call.args, **call.kwargs)
    ref, allowed = reference(bound.args, bound.kwargs)  # positional as the contract orders them
    if not bound.kwargs.get("return_lse"):
        return {"expected": np.asarray(ref, dtype=np.float64), "allowed": np.float64(allowed)}
    (ref, ref_lse), (allowed, allowed_lse) = ref, allowed
    return {"expected": np.asarray(ref, dtype=np.float64), "allowed": np.float64(allowed),
            "expected_lse": np.asarray(ref_lse, dtype=np.float64), "allowed_lse": np.float64(allowed_lse)}


def short_message(message: str, fixtures=()) -> str:
    """A failure message without the noise: hypothesis's failing example keeps its drawn
    arguments (the layout, the corruption), not the fixtures (`fixtures`: their names)
    nor the `@reproduce_failure` hint."""
    lines, out, skipping = str(message).strip().splitlines(), [], False
    for line in lines:
        if line.startswith("You can reproduce this test case") or line.startswith("You can add @seed"):
            continue
        m = re.match(r"^    (\w+)=", line)
        if m:
            skipping = m.group(1) in fixtures
        elif not line.startswith("     "):
            skipping = False
        if not skipping:
            out.append(line)
    return "\n".join(out[:40]).strip()


def write(call: Call | None, directory: Path, *, nodeid: str, impl, clauses=(), message: str = "",
          statement: str = "", max_bytes: int = MAX_BYTES) -> Repro:
    """Writes `directory/<name>.npz` and `directory/<name>.py` for one failed check.
    `impl` is the Implementation under test; `message` the failure as the check said it
    (short_message); returns what was written (or why not)."""
    if call is None:
        return Repro(note="none: the check made no call of the implementation")
    if call.unwritable:
        return Repro(note=f"not written: its last call is {call.unwritable}, outside the contract's signature")
    named = _named(call)
    size = sum(_size(v) for _, _, v in named)
    violation = contract_violation(call)
    if violation is None:
        size += _size(named[0][2]) * 2  # the float64 answer, about the query's shape (and its lse)
    if size > max_bytes:
        return Repro(note=f"not written: the call's arrays take {_human(size)}, over the "
                          f"{_human(max_bytes)} cap of a repro file")
    arrays, call_lines = {}, []
    try:
        for keyword, name, v in named:
            if isinstance(v, (mx.array, np.ndarray)):
                kind = "mlx" if isinstance(v, mx.array) else "numpy"
                dtype = str(v.dtype).removeprefix("mlx.core.")
                host = np.array(v.astype(mx.float32) if kind == "mlx" and v.dtype == mx.bfloat16 else v)
                arrays[name], arrays[name + "__dtype"], arrays[name + "__kind"] = host, np.str_(dtype), np.str_(kind)
                text = name
            else:
                text = _literal(v)
            call_lines.append((keyword, text))
    except _Unwritable as e:
        return Repro(note=f"not written: the call passes {e}, which a script cannot restate")
    mode = "match"
    if violation is not None:
        mode = "reject"
    else:
        try:
            arrays.update(_oracle(call))
        except Exception as e:  # noqa: BLE001 - an oracle that cannot compute this call: say so
            return Repro(note=f"not written: the float64 oracle failed on the call ({type(e).__name__}: {e})")
    directory.mkdir(parents=True, exist_ok=True)
    stem = file_name(nodeid)
    np.savez(directory / f"{stem}.npz", **arrays)
    script = directory / f"{stem}.py"
    spec = "impl:paged_attention" if impl.builtin else impl.name
    compared = [COMPARES_CALLS[c] for c in clauses if c in COMPARES_CALLS]
    script.write_text(render(stem=stem, nodeid=nodeid, spec=spec, mode=mode, violation=violation or "",
                              errors=tuple(t.__name__ for t in impl.caps.error_types), clauses=clauses,
                              message=message, statement=statement, compared=compared,
                              names=[name for _, name, v in named if isinstance(v, (mx.array, np.ndarray))],
                              call_lines=call_lines, arrays=arrays))
    note = ""
    if compared:
        note = "last call only (the check compares two calls)"
    return Repro(path=f"{directory.name}/{script.name}", note=note)
