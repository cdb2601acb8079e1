"""The text of a reproduction script (conformance/repro.py writes it beside its `.npz`).

The script needs numpy, mlx and the kernel only: it rebuilds the recorded arguments in
their dtypes, imports the kernel by `--impl MODULE:ATTR` (the failed one by default),
makes the call and judges it as the check did: within the float64 oracle's allowance
("match"; with `return_lse=True` the lse too, against the oracle's lse), or rejected with
one of the declared error types ("reject"). Exit status 1
while it fails, 0 when it passes, 2 where a rejection does not apply.
"""

from __future__ import annotations

import textwrap

def _safe(text: str) -> str:
    return str(text).replace("\\", "\\\\").replace('"""', "'''")  # as the docstring's source


def _describe(arrays: dict, names: list) -> str:
    parts = []
    for n in names:
        x = arrays[n]
        kind = "" if str(arrays[n + "__kind"]) == "mlx" else " (NumPy)"
        parts.append(f"{n} {str(arrays[n + '__dtype'])}{list(x.shape)}{kind}")
    return "; ".join(parts)


def render(*, stem, nodeid, spec, mode, violation, errors, clauses, message, statement, compared, names,
            call_lines, arrays) -> str:
    from .clauses import describe

    wrap = lambda text, indent="": textwrap.fill(" ".join(_safe(text).split()), 92, initial_indent=indent,  # noqa: E731
                                                 subsequent_indent=indent) if str(text).strip() else ""
    msg = "\n".join(_safe(line) for line in str(message).strip().splitlines()[:40])
    doc = [f"pagecheck reproduction of a failed check: {_safe(nodeid)}", ""]
    doc += [wrap(describe(c), "    ") for c in clauses] or ["    (no contract clause named)"]
    if statement.strip():
        doc += ["", "The check:", wrap(statement, "    ")]
    doc += ["", "It failed with:", textwrap.indent(msg or "(no message)", "    "), ""]
    if mode == "reject":
        doc += [wrap(f"The contract rejects this input ({violation}); the check passes when the kernel raises "
                     "one of its declared error types with a message, before computing anything."), ""]
    else:
        doc += [wrap("The answer is the float64 oracle's (pagecheck oracles.float64) on this input, and the "
                     "allowance the tolerance rule's (oracles/tolerance.py), both computed when the check failed."
                     + (" The call asks for the lse too (return_lse=True): it is judged against the oracle's lse "
                        "(-inf exactly on empty rows, within its allowance elsewhere)." if "expected_lse" in arrays
                        else "")),
                ""]
    if compared:
        doc += [wrap(f"This check compares the outputs of two calls ({'; '.join(compared)}). Only its last "
                     "call is reproduced here, against the oracle: a bitwise-invariance failure needs both calls "
                     "(rerun the check itself), and a pass here does not clear the check."), ""]
    doc += [
        wrap(f"Input ({stem}.npz beside this file): {_describe(arrays, names)}."),
        "",
        "Run it where the kernel imports (MODULE is imported with the normal sys.path; set PYTHONPATH):",
        "",
        f"    python {stem}.py                     # the kernel that failed: {spec}",
        f"    python {stem}.py --impl MODULE:ATTR  # another kernel (your fix; impl:paged_attention is pagecheck's)",
        "",
        "Needs numpy, mlx and the kernel only (a kernel declaring its own layout or page-table format is",
        "converted by pagecheck's conformance/, so that one needs the checkout on the path too).",
        "Exit status: 1 while it still fails, 0 when it passes, 2 when the kernel declares it does not",
        "validate its input (a rejection does not apply to it).",
    ]
    positional = ", ".join(text for keyword, text in call_lines if not keyword)
    keywords = ", ".join(f"{keyword}={text}" for keyword, text in call_lines if keyword)
    call = positional + (",\n                     " + keywords if positional and keywords else keywords)
    header = '"""' + "\n".join(doc).rstrip() + '\n"""'
    return (_TEMPLATE.replace("@@DOC@@", header).replace("@@SPEC@@", repr(spec)).replace("@@MODE@@", repr(mode))
            .replace("@@ERRORS@@", repr(errors)).replace("@@VIOLATION@@", repr(violation))
            .replace("@@DATA@@", repr(f"{stem}.npz")).replace("@@COMPARED@@", repr(bool(compared)))
            .replace("@@LOAD@@", "\n".join(f"    {n} = argument(data, {n!r})" for n in names))
            .replace("@@CALL@@", call))


_TEMPLATE = '''#!/usr/bin/env python3
@@DOC@@

import argparse
import importlib
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

IMPL = @@SPEC@@  # the kernel that failed (--impl overrides)
EXPECT = @@MODE@@  # "match": within the allowance of the oracle's answer; "reject": must raise
ERROR_TYPES = @@ERRORS@@  # the failed kernel's contract errors (a subclass counts)
VIOLATION = @@VIOLATION@@  # why the contract rejects the input (EXPECT == "reject")
TWO_CALLS = @@COMPARED@@  # the check compared two calls; this is the last one
DATA = Path(__file__).resolve().with_name(@@DATA@@)
NATIVE_KEYS = ("layout", "page_table", "query_packing", "window_convention", "lse_convention", "empty_lse",
               "alibi_convention", "kv_dtype_names")


def load_kernel(spec):
    module, _, attr = spec.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    declared = getattr(obj, "pagecheck_capabilities", None) or {}
    if any(k in declared for k in NATIVE_KEYS):
        from conformance.implementation import load  # its native format, converted as the check did

        return load(spec).fn, declared
    return obj, declared


def argument(data, name):
    """The argument as the check passed it: an mlx array in its dtype (bfloat16 is stored
    widened to float32, exactly), or a NumPy array."""
    value, dtype, kind = data[name], str(data[name + "__dtype"]), str(data[name + "__kind"])
    if kind == "numpy":
        return value.astype(dtype)
    return mx.array(value, dtype=getattr(mx, dtype))


def match_lse(lse, data):
    """The lse against the oracle's: float32, [B, Hq, L], -inf exactly where the oracle's
    is (an empty row), within the allowance elsewhere. True when it passes."""
    ref, allowed = data["expected_lse"], float(data["allowed_lse"])
    if not isinstance(lse, mx.array):
        print(f"FAIL: lse is {type(lse).__name__}, not an mlx.core.array")
        return False
    ok = True
    if lse.dtype != mx.float32:
        print(f"FAIL: lse dtype {lse.dtype}; the contract: float32")
        ok = False
    if tuple(lse.shape) != ref.shape:
        print(f"FAIL: lse shape {tuple(lse.shape)}; the contract: [B, Hq, L] = {ref.shape}")
        return False
    got = np.array(lse.astype(mx.float32), dtype=np.float64)
    empty = np.isneginf(ref)
    wrong_empty = int((empty & ~np.isneginf(got)).sum())
    diff = np.where(empty, 0.0, np.abs(got - np.where(empty, 0.0, ref)))
    diff[~np.isfinite(diff)] = np.inf
    err = float(diff.max()) if diff.size else 0.0
    print(f"lse: max |lse - ref| = {err:.3e}   allowed {allowed:.3e}; empty rows not -inf: {wrong_empty}")
    if wrong_empty or err > allowed:
        if err > allowed:
            worst = np.unravel_index(int(np.argmax(diff)), diff.shape)
            print(f"lse: worst element [b, h, l] = {tuple(int(i) for i in worst)}: lse {got[worst]:.6g}, "
                  f"ref {ref[worst]:.6g}")
        ok = False
    return ok


def match(call, data, query):
    ref, allowed = data["expected"], float(data["allowed"])
    with_lse = "expected_lse" in data.files
    try:
        out = call()
    except Exception as e:
        print(f"FAIL: the call raised {type(e).__name__}: {e} (the contract computes this input)")
        return 1
    lse = None
    if with_lse:
        if not (isinstance(out, tuple) and len(out) == 2):
            print(f"FAIL: returned {type(out).__name__}; with return_lse=True the contract returns (out, lse)")
            return 1
        out, lse = out
    if not isinstance(out, mx.array):
        print(f"FAIL: returned {type(out).__name__}, not an mlx.core.array")
        return 1
    failed = False
    if out.dtype != query.dtype:
        print(f"FAIL: output dtype {out.dtype}; the contract: the query's ({query.dtype})")
        failed = True
    if tuple(out.shape) != ref.shape:
        print(f"FAIL: output shape {tuple(out.shape)}; the contract: {ref.shape}")
        return 1
    got = np.array(out.astype(mx.float32), dtype=np.float64)
    diff = np.abs(got - ref)
    diff[~np.isfinite(diff)] = np.inf
    err = float(diff.max()) if diff.size else 0.0
    times = f" ({err / allowed:.3g} x the allowance)" if allowed > 0 and np.isfinite(err) else ""
    print(f"max |out - ref| = {err:.3e}   allowed {allowed:.3e}{times}")
    print(f"NaN in the output: {int(np.isnan(got).sum())} of {got.size}; inf: {int(np.isinf(got).sum())}")
    if err > allowed:
        failed = True
        worst = np.unravel_index(int(np.argmax(diff)), diff.shape)
        print(f"worst element [b, h, l, d] = {tuple(int(i) for i in worst)}: out {got[worst]:.6g}, "
              f"ref {ref[worst]:.6g}")
        off = np.unique(np.argwhere(~(diff <= allowed))[:, 0]).tolist()
        print(f"requests off: {off} of {ref.shape[0]}")
    if with_lse and not match_lse(lse, data):
        failed = True
    if TWO_CALLS:
        print("note: the check compared two calls; this is its last call against the oracle only")
    print("FAIL: still fails" if failed else "PASS: within the allowance of the float64 oracle")
    return 1 if failed else 0


def reject(call, spec, declared):
    if declared.get("validates_input") is False:
        print(f"N/A: {spec} declares validates_input=False (the check is skipped for it)")
        return 2
    names = ERROR_TYPES
    if spec != IMPL:
        kinds = declared.get("error_types")
        kinds = kinds if isinstance(kinds, (list, tuple)) else [kinds] if kinds else []
        names = tuple(k.__name__ for k in kinds) or ("ValueError", "TypeError")
    try:
        out = call()
    except Exception as e:
        raised = [c.__name__ for c in type(e).__mro__]
        if not any(n in raised for n in names):
            print(f"FAIL: raised {type(e).__name__}: {e}; not one of the declared error types {list(names)}")
            return 1
        if not str(e).strip():
            print(f"FAIL: raised {type(e).__name__} with an empty message")
            return 1
        print(f"PASS: rejected with {type(e).__name__}: {e}")
        return 0
    what = f"an array {out.dtype}{list(out.shape)}" if isinstance(out, mx.array) else type(out).__name__
    if isinstance(out, tuple):
        what = "(" + ", ".join(f"{x.dtype}{list(x.shape)}" if isinstance(x, mx.array) else type(x).__name__
                               for x in out) + ")"
    print(f"FAIL: accepted, returned {what}; the contract rejects this input: {VIOLATION}")
    return 1


def main(argv=None):
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--impl", default=IMPL, metavar="MODULE:ATTR", help=f"the kernel to run (default {IMPL})")
    spec = parser.parse_args(argv).impl
    kernel, declared = load_kernel(spec)
    data = np.load(DATA)
@@LOAD@@

    def call():
        out = kernel(@@CALL@@)
        arrays = [x for x in (out if isinstance(out, tuple) else (out,)) if isinstance(x, mx.array)]
        if arrays:
            mx.eval(*arrays)
        return out

    print(f"kernel: {spec}")
    if EXPECT == "reject":
        return reject(call, spec, declared)
    return match(call, data, query)


if __name__ == "__main__":
    sys.exit(main())
'''
