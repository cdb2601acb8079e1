"""The cached twin of a decode from DRAM: the arithmetic side of issue 22's point 5.

A decode whose K/V come from DRAM waits on the memory and on its own arithmetic; how
much of the arithmetic it hides under the memory's time decides how near it comes to
the read stream timed beside it. Its twin is the same serving path on a decode of the
same dtype and page size whose K/V (TWIN_KV_BYTES) stay in the last-level cache: the
rate its loops consume K/V when memory never makes them wait. The report times it in
the same turns as the decode from DRAM and its read stream (bench/report.py:
`cached_gbytes_per_s`), and the DRAM goal's profile sets the three side by side
(bench/goals.py `_dram_profile`).

| symbol            | meaning                                               | value              |
|-------------------|-------------------------------------------------------|--------------------|
| TWIN_BATCH        | requests of the twin                                  | 4                  |
| TWIN_KV_BYTES     | its K/V bytes: a quarter of the AMD machine's 32 MiB L3, so they stay there between calls with room for the rest | 8 MiB |
| context           | TWIN_KV_BYTES / (batch x Hkv x D x 2 x itemsize), whole pages | f32 256, bf16 512 |

The twin's rate counts its call's fixed costs (the checks, the hand-off of the work
items: 10-20 us of a 0.1-0.2 ms call), so it is a floor of the loops' own rate. Its
calls stay within value_pass.h's kCachedKvBytes, so they weigh a decode's values in 64 KiB
spans and, for bf16, without asking for the next V rows: the configuration the kernel
runs from cache, not the one it runs from DRAM.
"""

from __future__ import annotations

from . import grid, paths
from .goals import SERVING_PATHS

TWIN_BATCH = 4
TWIN_KV_BYTES = 8 << 20


def twin(spec: grid.Spec) -> grid.Spec:
    """The decode of `spec`'s dtype and page size whose K/V are TWIN_KV_BYTES."""
    if spec.op != "decode":
        raise ValueError(f"a cached twin is a decode's; got a {spec.op} spec {spec.id}")
    row_bytes = TWIN_BATCH * grid.SHAPE["kv_heads"] * grid.SHAPE["head_dim"] * 2 * grid.ITEMSIZE[spec.dtype]
    context = TWIN_KV_BYTES // row_bytes // spec.page_size * spec.page_size
    if context < spec.page_size:
        raise ValueError(f"pages of {spec.page_size} {spec.dtype} keys do not fit {TWIN_KV_BYTES} bytes of K/V")
    return grid.Spec("decode", TWIN_BATCH, context, spec.page_size, spec.dtype, 1)


def serving_path(spec: grid.Spec) -> str:
    """The serving path the goals judge on `spec` (goals.SERVING_PATHS), the first not skipped."""
    return next(path for path in SERVING_PATHS if grid.skip_reason(spec, path) is None)


class Twins:
    """The cached twins of the decodes in `specs` that read at least `floor_bytes`, one
    per (page size, dtype), built at once: each twin has its own small pool, made before
    any vLLM cache conversion of the big ones (a new pool drops paths' conversion memo)."""

    def __init__(self, specs, floor_bytes: int):
        self.floor_bytes = floor_bytes
        self._runs = {}
        for spec in specs:
            key = (spec.page_size, spec.dtype)
            if self.applies(spec) and key not in self._runs:
                small, path = twin(spec), serving_path(spec)
                pools = paths.Pools([small])
                self._runs[key] = (small, paths.make(path, pools.case_for(small, path)))

    def applies(self, spec: grid.Spec) -> bool:
        """Whether `spec` is a decode from DRAM: at least floor_bytes of K/V and the rest."""
        return spec.op == "decode" and spec.io_bytes() >= self.floor_bytes

    def for_spec(self, spec: grid.Spec):
        """(twin spec, its zero-argument call) for a decode from DRAM, else None."""
        return self._runs.get((spec.page_size, spec.dtype)) if self.applies(spec) else None
