"""The machine's limits, measured in the same run as the cases they judge, and its versions.

| limit                 | how                                                                  |
|-----------------------|----------------------------------------------------------------------|
| `read_gbytes_per_s`   | numpy max over a float32 array of 4x the last-level cache (at least 256 MB; `read_bytes`), split across as many threads as the kernel uses (numpy releases the GIL in reductions); best of 7. Max, not sum: numpy's float32 sum is pairwise and runs at about 7 GB/s a thread even from cache, so it measured its own arithmetic, not the memory (half the real rate here). 4x the cache, because this machine's L3 is 300 MiB: the earlier 256 MB array fit in it, and whenever the other tenants left the L3 alone the "memory" rate read 60 GB/s, twice what the DRAM gives a 1 GB decode |
| `sgemm_gflops`        | numpy float32 matmul 2048^3 in a subprocess whose BLAS gets the kernel's thread count (OPENBLAS_NUM_THREADS); best of 5 |
| `fma_gflops`          | the kernels' own threads issuing independent fused multiply-add chains at the build's widest vectors (`pagecheck_kernels.fma_peak_gflops`: the thread count times the fastest thread's own rate, best of the repeats in 0.5 s): the arithmetic ceiling of any float32 FMA kernel, ours included. numpy's sgemm reaches well under it here, so a rate above sgemm is not yet a rate near the machine's limit; a peer above it is not using float32 FMAs at all (torch's bf16 SDPA runs on AMX tiles) |

Best-of, not median: a limit is what the machine can do, and the machine is shared.
A decode case's `bandwidth_fraction` is taken against the same read (`ReadStream`)
timed in turns beside it instead (bench/report.py), so that both see the same load.
"""

from __future__ import annotations

import datetime
import glob
import importlib.metadata
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np
import pagecheck_kernels

import impl
from impl.runtime import KERNEL_STREAM
from peers import cpuinfo

MIN_READ_BYTES = 256 * 10**6
SGEMM_N = 2048
FMA_SECONDS = 0.5

_SGEMM = """
import time, numpy as np
n = {n}
a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
b = np.random.default_rng(1).standard_normal((n, n), dtype=np.float32)
a @ b
best = min(__import__("timeit").repeat(lambda: a @ b, number=1, repeat=5))
print(2 * n ** 3 / best / 1e9)
"""


def last_level_cache_bytes() -> int | None:
    """Size of the largest CPU cache that sysfs lists for cpu0 (None where it lists none)."""
    sizes = []
    for size in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            text = open(size).read().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes) if sizes else None


def read_bytes() -> int:
    """Bytes the read limit streams: 4x the last-level cache, at least MIN_READ_BYTES."""
    return max(MIN_READ_BYTES, 4 * (last_level_cache_bytes() or 0))


class ReadStream:
    """One call reads `nbytes` (default `read_bytes()`) of float32 once: a numpy max over
    `threads` slices on as many threads (one compare per element: the loads, not the
    arithmetic, bound it). The read limit, and the reference a decode case is timed
    beside (bench/report.py)."""

    def __init__(self, threads: int, nbytes: int | None = None):
        self.data = np.ones((nbytes or read_bytes()) // 4, dtype=np.float32)
        self.nbytes = self.data.nbytes
        self._slices = np.array_split(self.data, threads)
        self._pool = ThreadPoolExecutor(threads)

    def __call__(self):
        return list(self._pool.map(np.max, self._slices))

    def close(self) -> None:
        self._pool.shutdown()
        self.data = self._slices = None


class StreamRoundTrip:
    """One call evaluates a 4-element add on the stream that runs pagecheck's kernels
    (impl.runtime.KERNEL_STREAM): the caller hands the op to MLX's stream thread and
    waits for it, as every paged call does. Timed beside the small cases: the floor of
    any MLX-dispatched call, which a kernel run in the calling thread (vLLM's op) has not."""

    def __init__(self):
        self._x = mx.zeros((4,))
        mx.eval(self._x)

    def __call__(self):
        out = mx.add(self._x, 1.0, stream=KERNEL_STREAM)
        mx.eval(out)
        return out


def read_bandwidth(threads: int, nbytes: int | None = None, repeat: int = 7) -> float:
    """GB/s of the best of `repeat` ReadStream calls."""
    stream = ReadStream(threads, nbytes)
    try:
        best = float("inf")
        for _ in range(repeat):
            t0 = time.perf_counter()
            stream()
            best = min(best, time.perf_counter() - t0)
        return stream.nbytes / best / 1e9
    finally:
        stream.close()


def sgemm_rate(threads: int, n: int = SGEMM_N) -> float:
    """GFLOP/s of numpy's float32 matmul n^3 with `threads` BLAS threads."""
    env = dict(os.environ, OPENBLAS_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads),
               MKL_NUM_THREADS=str(threads))
    out = subprocess.run([sys.executable, "-c", _SGEMM.format(n=n)], env=env, check=True,
                         capture_output=True, text=True, timeout=600)
    return float(out.stdout.strip())


def limits() -> dict:
    threads, nbytes = impl.num_threads(), read_bytes()
    return {"threads": threads, "read_gbytes_per_s": read_bandwidth(threads, nbytes),
            "sgemm_gflops": sgemm_rate(threads), "fma_gflops": pagecheck_kernels.fma_peak_gflops(FMA_SECONDS),
            "read_bytes": nbytes, "sgemm_n": SGEMM_N, "load_average": _load()}


def _load() -> float | None:
    """The 1-minute load average: other jobs on a shared machine move every figure."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def best_of(*measured: dict) -> dict:
    """Limits measured more than once in a run (start and end): the higher of each, and
    every load average."""
    out = dict(measured[0], load_average=[m["load_average"] for m in measured])
    for m in measured[1:]:
        for key in ("read_gbytes_per_s", "sgemm_gflops", "fma_gflops"):
            out[key] = max(out[key], m[key])
    return out


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    """The model name and, where the name alone does not tell the core (a VM's "AMD EPYC"
    is Zen 4 or Zen 5, whose 512-bit FMAs and so whose loops differ), its cpuid family
    and model: "AMD EPYC (family 26, model 2)"."""
    name = cpuinfo("model name") or platform.processor() or platform.machine()
    family, model = cpuinfo("cpu family"), cpuinfo("model")
    return f"{name} (family {family}, model {model})" if family and model else name


def info() -> dict:
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(), "cpu": _cpu_model(), "cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "kernel_threads": impl.num_threads(), "python": platform.python_version(),
        "versions": {d: _version(d) for d in ("mlx", "numpy", "torch", "pytest-benchmark", "matplotlib",
                                              "pagecheck")},
    }
