"""Worker threads of the CPU kernels.

The count starts at `$PAGECHECK_NUM_THREADS` when that holds a positive integer, else
at the number of CPUs the process may use. Results do not depend on it (invariant 7).
"""

from __future__ import annotations

import operator

import mlx.core as mx
import pagecheck_kernels as _kernels

# The device whose default stream runs every pagecheck primitive (attention, pool writes
# and copies), whatever mx.default_device() is: they have no GPU kernel, and where the
# default is the GPU (MLX on macOS) a primitive left on the default stream reaches
# eval_gpu and raises. On unified memory the CPU reads the same buffers at no cost.
KERNEL_STREAM = mx.cpu


def num_threads() -> int:
    return _kernels.num_threads()


def set_num_threads(n: int) -> None:
    if isinstance(n, bool):
        raise ValueError(f"number of threads must be an int >= 1, got {n!r}")
    n = operator.index(n)
    if n < 1:
        raise ValueError(f"number of threads must be >= 1, got {n}")
    _kernels.set_num_threads(n)


def amx_supported() -> bool:
    """Whether bfloat16 calls can run on AMX tiles here: a build with AVX512-BF16, a CPU
    with AMX-BF16, and Linux granting the process the tile state."""
    return _kernels.amx_supported()


def amx_enabled() -> bool:
    """Whether bfloat16 calls (head dim a multiple of 32) run on AMX tiles now. On where
    supported, unless `$PAGECHECK_AMX` was 0 when the kernels loaded."""
    return _kernels.amx_enabled()


def set_amx(on: bool) -> None:
    """Switch the tile path of bfloat16 calls on or off for the calls evaluated after it.

    The tile path is its own canonical arithmetic (impl/csrc/amx.h): invariants 6-8 hold
    within it, its bits differ from the float32-FMA path's. On raises ValueError where
    `amx_supported()` is false."""
    if not isinstance(on, bool):
        raise ValueError(f"set_amx takes True or False, got {on!r}")
    _kernels.set_amx(on)


def pair_dots_supported() -> bool:
    """Whether bfloat16 scores can run on AVX512-BF16's pair dot product (vdpbf16ps) in
    this build (impl/csrc/pair_dots.h)."""
    return _kernels.pair_dots_supported()


def pair_dots_enabled() -> bool:
    """Whether they do now: on where supported and the CPU issues it at the FMA rate (AMD),
    unless `$PAGECHECK_PAIR_DOTS` (0 or 1) said otherwise when the kernels loaded."""
    return _kernels.pair_dots_enabled()


def set_pair_dots(on: bool) -> None:
    """Switch the pair dot product of bfloat16 scores on or off for later calls. A choice
    of speed only: the bits are the FMA loop's either way (queries or K blocks with an
    element below 2^-51 in magnitude take the FMA loop). On raises ValueError where
    `pair_dots_supported()` is false."""
    if not isinstance(on, bool):
        raise ValueError(f"set_pair_dots takes True or False, got {on!r}")
    _kernels.set_pair_dots(on)


def transposed_pairs_enabled() -> bool:
    """Whether a prefill scores its transposed K blocks two at a time now: on where one
    block at a time is bound by its loads (Intel's cores, AMD's Zen 5; not Zen 4), unless
    `$PAGECHECK_TRANSPOSED_PAIRS` (0 or 1) said otherwise when the kernels loaded; False in
    a build without AVX-512 (impl/csrc/transposed.h)."""
    return _kernels.transposed_pairs_enabled()


def set_transposed_pairs(on: bool) -> None:
    """Switch a prefill's transposed K blocks in pairs on or off for later calls. A choice
    of speed only: the bits are the same either way. On raises ValueError in a build
    without AVX-512."""
    if not isinstance(on, bool):
        raise ValueError(f"set_transposed_pairs takes True or False, got {on!r}")
    _kernels.set_transposed_pairs(on)


def output_cache_stats() -> dict:
    """The kept buffer of large outputs (impl/csrc/output_cache.h): `reused`, outputs of
    32-512 MiB given the buffer a dead output of the same size left; `fresh`, those given
    a new one (which Linux faults in and zeroes); `held`, the bytes kept now (one buffer
    at most, freed by a call of another size or by release_output_cache)."""
    return dict(_kernels.output_cache_stats())


def release_output_cache() -> int:
    """Frees the kept output buffer; returns its bytes (0 when none was kept)."""
    return _kernels.release_output_cache()

