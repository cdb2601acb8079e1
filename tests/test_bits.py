"""bits(): the value every bit-for-bit check compares (fixtures/bits.py), and how a failed
comparison is explained: what differs, never pytest's quadratic diff of the bytes."""

import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from fixtures.bits import Bits, bits, explain

ROOT = Path(__file__).resolve().parent.parent


def test_bits_compare_the_words_of_one_shape():
    a = mx.array(np.arange(4, dtype=np.float32))
    assert bits(a) == bits(mx.array(np.arange(4, dtype=np.float32)))
    assert bits(a) != bits(a.reshape(2, 2))  # the same bytes, another array
    assert bits(a) != bits(a.view(mx.uint16))  # the same bytes read as other words
    assert len({bits(a), bits(a + 0), bits(a.reshape(2, 2))}) == 2
    assert bytes(bits(a)) == np.arange(4, dtype=np.float32).tobytes()


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_half_floats_are_their_uint16_words(dtype):
    x = mx.array([1.0, -2.0, 0.5], dtype=dtype)
    assert bits(x) == Bits(np.array(x.view(mx.uint16)).tobytes(), (3,), "uint16")
    assert bits(x) == bits(np.array(x.view(mx.uint16)))  # the same words from NumPy


def test_a_difference_is_explained_by_its_first_element_and_count():
    a = np.zeros((2, 3, 4), dtype=np.float32)
    b = a.copy()
    b[1, 2, 1], b[1, 2, 3] = 1.0, -0.0
    left, right = bits(a), bits(b)
    assert explain(left, right) == [
        f"{left!r} == {right!r}",
        "2 of 24 elements differ; the first at index (1, 2, 1): 0x00000000 against 0x3f800000"]
    assert repr(left).startswith("Bits(2x3x4 uint32, sha256 ") and len(repr(left)) < 60
    assert explain(left, bits(a[0])) == [
        f"{left!r} == {bits(a[0])!r}", "shapes or element sizes differ: (2, 3, 4) uint32 against (3, 4) uint32"]


@pytest.mark.parametrize("plugin", ["conformance", "none"])
def test_a_failed_comparison_under_ci_is_explained_without_a_diff_of_the_bytes(tmp_path, plugin):
    """pytest explains a failed `==` of two byte strings, under -v or wherever CI is set, with
    an ndiff of both pretty-printed: 8 s for 4 KiB of float32 differing everywhere, 76 s for
    16 KiB, hours for a user's CI checking a wrong kernel. A failed `==` of two bits() is
    explained by what differs where the conformance plugin runs (the whole explanation: these
    two lines), and by pytest alone without it: never by their bytes, nor their fields'."""
    check = tmp_path / "test_wrong_kernel.py"
    check.write_text("import mlx.core as mx\nimport numpy as np\nfrom fixtures import bits\n\n"
                     "def test_outputs_agree():\n"
                     "    a = np.linspace(-1, 1, 1024, dtype=np.float32).reshape(4, 256)\n"
                     "    assert bits(mx.array(a)) == bits(mx.array(a * np.float32(1.0001)))\n")
    env = dict(os.environ, CI="true", PYTHONPATH=str(ROOT))
    plugins = ["-p", "conformance.plugin"] if plugin == "conformance" else []
    proc = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", *plugins,
                           "--rootdir", str(tmp_path), str(check)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    a = np.linspace(-1, 1, 1024, dtype=np.float32).reshape(4, 256)
    left, right = bits(a), bits(a * np.float32(1.0001))
    said = [line[1:].strip() for line in proc.stdout.splitlines() if line.startswith("E ")]
    if plugin == "none":  # pytest's own words: the operands and where they came from, nothing of their bytes
        assert said[0].endswith(f"assert {left!r} == {right!r}")
        assert [line for line in said if "b'" in line or "attributes" in line or "diff" in line.lower()] == []
        return
    assert said == [f"assert {left!r} == {right!r}", *explain(left, right)[1:]]
    assert said[1] == "1024 of 1024 elements differ; the first at index (0, 0): 0xbf800000 against 0xbf800347"
