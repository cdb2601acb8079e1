"""gpu/compile.py: the Triton kernels compile for Hopper (sm_90a) without a GPU, spill-free,
within the register and shared-memory limits; and its parsers read the tools' output.

The compile runs `python -m gpu.compile --quick` in a subprocess (TRITON_INTERPRET=0: in this
process gpu.paged may already have turned the kernels into interpreter functions) once for
the module: ~50 s on 2 cores, ~33 variants covering every constexpr branch and dtype.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="gpu/compile.py plans launches with torch tensors")
pytest.importorskip("triton", reason="gpu/compile.py compiles with triton")

from gpu.compile import MAX_SHARED  # noqa: E402
from gpu.ptxas import parse_ptxas, parse_res_usage  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KERNELS = {"decode_split_kernel", "merge_kernel", "prefill_kernel"}
DTYPES = {"float16", "bfloat16", "float32"}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_compile") / "rows.json"
    env = dict(os.environ, TRITON_INTERPRET="0",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.pop("TRITON_ALLOW_NON_CONSTEXPR_GLOBALS", None)  # compile as a GPU run would
    proc = subprocess.run([sys.executable, "-m", "gpu.compile", "--quick", "--json", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    rows = json.loads(out.read_text()) if out.exists() else []
    return proc, rows


def _bad(rows, pred):
    return [f"{r['kernel']} [{r['variant']}]: {r['error'] or r}" for r in rows if pred(r)]


def test_compiles_every_variant(compiled):
    proc, rows = compiled
    assert rows, f"no rows written (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    errors = _bad(rows, lambda r: r["error"])
    assert not errors, "compile errors:\n" + "\n".join(errors)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_every_kernel_and_dtype(compiled):
    _, rows = compiled
    assert {r["kernel"] for r in rows} >= KERNELS
    for kernel in KERNELS:
        assert {r["dtype"] for r in rows if r["kernel"] == kernel} >= DTYPES, kernel


def test_registers_in_range(compiled):
    _, rows = compiled
    bad = _bad(rows, lambda r: not r["error"] and not 0 < r["registers"] <= 255)
    assert not bad, "registers out of (0, 255]:\n" + "\n".join(bad)


def test_no_spills(compiled):
    _, rows = compiled
    bad = [f"{r['kernel']} [{r['variant']}]: {r['spill_stores']} B stored / {r['spill_loads']} B loaded, "
           f"{r['registers']} registers, tiles {r['meta']}"
           for r in rows if not r["error"] and (r["spill_stores"] or r["spill_loads"])]
    assert not bad, "register spills:\n" + "\n".join(bad)


def test_shared_memory_fits_hopper(compiled):
    _, rows = compiled
    bad = _bad(rows, lambda r: not r["error"] and not 0 <= r["shared_bytes"] <= MAX_SHARED)
    assert MAX_SHARED == 227 * 1024
    assert not bad, "shared memory over 227 KiB per block:\n" + "\n".join(bad)


# --- the parsers, on captured output of triton 3.6's bundled ptxas / cuobjdump (CUDA 12.x) ---
PTXAS_LOG = """\
ptxas info    : 11 bytes gmem
ptxas info    : Compiling entry function 'prefill_kernel' for 'sm_90a'
ptxas info    : Function properties for prefill_kernel
    5928 bytes stack frame, 11312 bytes spill stores, 18184 bytes spill loads
ptxas info    : Used 32 registers, used 1 barriers, 5928 bytes cumulative stack size
ptxas info    : Compile time = 1259.376 ms
ptxas info    : Compiling entry function 'merge_kernel' for 'sm_90a'
ptxas info    : Function properties for merge_kernel
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 16 registers, used 0 barriers
ptxas info    : Compile time = 5.664 ms
"""

RES_USAGE = """
Resource usage:
 Common:
  GLOBAL:11 CONSTANT[4]:8
 Function merge_kernel:
  REG:16 STACK:0 SHARED:0 LOCAL:0 CONSTANT[0]:616 TEXTURE:0 SURFACE:0 SAMPLER:0
 Function prefill_kernel:
  REG:32 STACK:5928 SHARED:1024 LOCAL:0 CONSTANT[0]:688 TEXTURE:0 SURFACE:0 SAMPLER:0
"""


def test_parse_ptxas():
    funcs = parse_ptxas(PTXAS_LOG)
    assert funcs["prefill_kernel"] == dict(stack=5928, spill_stores=11312, spill_loads=18184, registers=32)
    assert funcs["merge_kernel"] == dict(stack=0, spill_stores=0, spill_loads=0, registers=16)
    assert parse_ptxas("") == {}
    assert parse_ptxas("ptxas fatal   : Unresolved extern function 'foo'\n") == {}


def test_parse_res_usage():
    funcs = parse_res_usage(RES_USAGE)
    assert set(funcs) == {"merge_kernel", "prefill_kernel"}
    assert funcs["prefill_kernel"]["REG"] == 32 and funcs["prefill_kernel"]["STACK"] == 5928
    assert funcs["prefill_kernel"]["SHARED"] == 1024
    assert funcs["merge_kernel"] == {"REG": 16, "STACK": 0, "SHARED": 0, "LOCAL": 0, "CONSTANT[0]": 616,
                                     "TEXTURE": 0, "SURFACE": 0, "SAMPLER": 0}
    assert parse_res_usage("") == {}
