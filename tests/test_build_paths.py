"""The AVX-512 block loops and the plain loops must give the same bits.

blocks.h claims its vector path performs exactly the floating-point operations of the
canonical scalar arithmetic (numerics.h). This builds the kernels a second time with
AVX-512 off (AVX2 + FMA, so fused multiply-adds round the same way), runs one set of
cases through both builds in separate processes and compares a hash of the raw output
bytes. The build is cached under build/avx2-check; the first run takes ~20 s.

Both builds run with the AMX tile path off (PAGECHECK_AMX=0): the tiles are a second
arithmetic for bfloat16 that no plain build can reproduce (impl/csrc/amx.h), checked
on its own in test_amx.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from peers import cpu_flags

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "build" / "avx2-check"

CASES = """
import hashlib, impl, pagecheck_kernels
from fixtures import paged_case, bits
h = hashlib.sha256()
for dt in ["float32", "bfloat16", "float16"]:
    for L in [1, 5, 20]:
        for D in [64, 128, 48]:
            c = paged_case(context_lens=[600, L, 0, 77], query_len=L, q_heads=8, kv_heads=2,
                           head_dim=D, page_size=16, dtype=dt, window=200 if L == 5 else None, seed=L * D)
            h.update(bytes(bits(c.run(impl.paged_attention))))
for dt in ["float32", "bfloat16"]:  # weights on both sides of exp2's edge within a vector of keys
    c = paged_case(context_lens=[300, 17], query_len=1, q_heads=4, kv_heads=2, head_dim=64, page_size=16,
                   dtype=dt, scale=30.0, seed=7)
    h.update(bytes(bits(c.run(impl.paged_attention))))
print(h.hexdigest())
"""


def _has(flag: str) -> bool:
    return flag in cpu_flags()


def _run(pythonpath: str) -> str:
    env = {**os.environ, "PYTHONPATH": pythonpath, "PAGECHECK_AMX": "0"}
    return subprocess.run([sys.executable, "-c", CASES], env=env, cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout.strip()


@pytest.mark.slow
def test_vector_and_plain_loops_give_the_same_bits():
    if not (_has("avx512f") and _has("fma") and shutil.which("cmake")):
        pytest.skip("needs an AVX-512 + FMA machine and cmake to build both paths")
    subprocess.run(["cmake", "-S", str(ROOT), "-B", str(BUILD), "-DPAGECHECK_NATIVE=OFF",
                    "-DCMAKE_BUILD_TYPE=Release", f"-DPython_EXECUTABLE={sys.executable}",
                    "-DCMAKE_CXX_FLAGS=-mavx2 -mfma -mf16c"], check=True, capture_output=True)
    subprocess.run(["cmake", "--build", str(BUILD), "-j2"], check=True, capture_output=True)
    package = BUILD / "pkg" / "pagecheck_kernels"
    package.mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "impl" / "csrc" / "pagecheck_kernels_init.py", package / "__init__.py")
    for so in BUILD.glob("_kernels*.so"):
        shutil.copy(so, package / so.name)
    native = _run(str(ROOT))
    plain = _run(os.pathsep.join([str(BUILD / "pkg"), str(ROOT)]))
    assert native == plain
