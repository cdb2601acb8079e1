"""pagecheck's GPU room: paged attention in Triton (an optional extra: `pip install '.[gpu]'`).

| module            | job |
|-------------------|-----|
| `gpu.kernels`     | the Triton kernels: split-KV decode, its merge, the tiled prefill |
| `gpu.paged`       | `attention` on torch tensors (the contract's signature), its launch plan, and `paged_attention` behind the torch bridge for `--impl gpu.paged:paged_attention` |
| `gpu.checks`      | the contract's rejections on torch tensors, before any launch |
| `gpu.compile`     | every kernel variant compiled for Hopper (sm_90) without a GPU: registers, spills, shared memory |
| `gpu.h200`, `gpu/h200.sh` | the prepared measurement run for a lent H200 |

Where torch sees no CUDA device the kernels run under Triton's interpreter on CPU tensors:
`TRITON_INTERPRET=1` is set here unless the environment already says (gpu.compile runs
with `TRITON_INTERPRET=0` to compile for a GPU it lacks). It must be set before triton is
first imported (conftest.py sets it for the tests): a process that imported triton in
compiled mode gets a RuntimeError here rather than kernels that cannot run.
"""

import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if "triton" in sys.modules and os.environ["TRITON_INTERPRET"] == "1":
        # triton decorated its library (tl.cdiv, tl.max, ...) when imported: in compiled
        # mode if the variable was not set yet, and a kernel under the interpreter cannot
        # call those. Loud, not a skip: the verification would silently not run.
        from triton.language import standard
        from triton.runtime.interpreter import InterpretedFunction

        if not isinstance(standard.cdiv, InterpretedFunction):
            raise RuntimeError("triton was imported before TRITON_INTERPRET=1 was set: import gpu (or set "
                               "TRITON_INTERPRET=1) before triton, or torch code that imports it")
