"""Worker threads of the CPU kernels.

The count starts at `$PAGECHECK_NUM_THREADS` when that holds a positive integer, else
at the number of CPUs the process may use. Results do not depend on it (invariant 7).
"""

from __future__ import annotations

import operator

import pagecheck_kernels as _kernels


def num_threads() -> int:
    return _kernels.num_threads()


def set_num_threads(n: int) -> None:
    if isinstance(n, bool):
        raise ValueError(f"number of threads must be an int >= 1, got {n!r}")
    n = operator.index(n)
    if n < 1:
        raise ValueError(f"number of threads must be >= 1, got {n}")
    _kernels.set_num_threads(n)
