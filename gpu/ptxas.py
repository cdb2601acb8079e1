"""What the CUDA tools print about a compiled kernel, read back (gpu/compile.py's checks).

| function          | reads                                   | gives, per function                              |
|-------------------|-----------------------------------------|--------------------------------------------------|
| `parse_ptxas`     | `ptxas -v` (its stderr)                 | registers, stack, spill_stores, spill_loads       |
| `parse_res_usage` | `cuobjdump -res-usage` on a cubin       | REG, STACK, SHARED, LOCAL, ... as printed         |
| `tool`            | -                                       | the path of triton's bundled tool of that name    |
"""

from __future__ import annotations

import re

_FUNC = re.compile(r"(?:Compiling entry function|Function properties for)\s+'?([\w$.]+)'?")
_FRAME = re.compile(r"(\d+)\s+bytes stack frame,\s*(\d+)\s+bytes spill stores,\s*(\d+)\s+bytes spill loads")
_USED = re.compile(r"Used\s+(\d+)\s+registers")


def parse_ptxas(log: str) -> dict:
    """`ptxas -v` output -> {function: {registers, stack, spill_stores, spill_loads}} (the
    keys it printed). A non-entry function ptxas kept (noinline) gets its own entry."""
    funcs: dict = {}
    cur = None
    for line in log.splitlines():
        m = _FUNC.search(line)
        if m:
            cur = funcs.setdefault(m.group(1), {})
            continue
        if cur is None:
            continue
        m = _FRAME.search(line)
        if m:
            cur.update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        m = _USED.search(line)
        if m:
            cur["registers"] = int(m.group(1))
    return funcs


_RES_FUNC = re.compile(r"^\s*Function\s+([\w$.]+)\s*:\s*$")
_RES_PAIR = re.compile(r"([A-Z_]+(?:\[\d+\])?)\s*:\s*(\d+)")


def parse_res_usage(text: str) -> dict:
    """`cuobjdump -res-usage` output -> {function: {"REG": n, "STACK": n, "SHARED": n, "LOCAL": n, ...}}."""
    funcs: dict = {}
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = _RES_FUNC.match(line)
        if m:
            body = lines[i + 1] if i + 1 < len(lines) else ""
            funcs[m.group(1)] = {k: int(v) for k, v in _RES_PAIR.findall(body)}
    return funcs


def tool(name: str) -> str:
    """The path of triton's bundled CUDA tool `name` (ptxas, cuobjdump)."""
    from triton import knobs

    return getattr(knobs.nvidia, name.replace("-", "_")).path
