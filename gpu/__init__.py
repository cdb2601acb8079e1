"""pagecheck's GPU room: paged attention in Triton (an optional extra: `pip install '.[gpu]'`).

| module            | job |
|-------------------|-----|
| `gpu.kernels`     | the Triton kernels: split-KV decode, its merge, the tiled prefill |
| `gpu.paged`       | `attention` on torch tensors (the contract's signature), its launch plan, and `paged_attention` behind the torch bridge for `--impl gpu.paged:paged_attention` |
| `gpu.checks`      | the contract's rejections on torch tensors, before any launch |
| `gpu.compile`     | every kernel variant compiled for Hopper (sm_90) without a GPU: registers, spills, shared memory |
| `gpu.h200`, `gpu/h200.sh` | the prepared measurement run for a lent H200 |

Where torch sees no CUDA device the kernels run under Triton's interpreter on CPU tensors:
`TRITON_INTERPRET=1` is set here, before any kernel is decorated, unless the environment
already says (gpu.compile runs with `TRITON_INTERPRET=0` to compile for a GPU it lacks).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
