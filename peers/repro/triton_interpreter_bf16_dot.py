"""triton 3.6.0's interpreter (TRITON_INTERPRET=1): `tl.dot` of bfloat16 tiles is wrong
(upstream triton #11584), so every bf16 kernel run on the CPU interpreter, vLLM's Triton
attention included, returns garbage (errors ~1e8 on unit-scale data). Not vLLM's defect:
it is why peers/vllm_triton.py declares float32 and float16 only.

One 16x16 @ 16x16 product, float32 accumulation, against torch's float32 matmul of the
same (exactly representable) bf16 inputs; float16 shown for contrast.

    python peers/repro/triton_interpreter_bf16_dot.py   # needs torch==2.13.0, triton==3.6.0, numpy<2.3
Exit 1 while the bf16 product is wrong, 0 once fixed.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import sys  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def dot_kernel(a_ptr, b_ptr, c_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    a = tl.load(a_ptr + i[:, None] * N + i[None, :])
    b = tl.load(b_ptr + i[:, None] * N + i[None, :])
    c = tl.dot(a, b, out_dtype=tl.float32)
    tl.store(c_ptr + i[:, None] * N + i[None, :], c)


N, wrong = 16, False
g = torch.Generator().manual_seed(0)
a32, b32 = torch.randn(N, N, generator=g), torch.randn(N, N, generator=g)
for dtype in (torch.float16, torch.bfloat16):
    a, b = a32.to(dtype), b32.to(dtype)
    c = torch.empty(N, N, dtype=torch.float32)
    dot_kernel[(1,)](a, b, c, N=N)
    err = (c - a.float() @ b.float()).abs().max().item()
    bad = not err < 1e-3
    wrong |= bad and dtype == torch.bfloat16
    print(f"tl.dot {str(dtype):15} max abs error vs torch: {err:.3e} {'WRONG' if bad else 'ok'}")
print(f"DEFECT (triton {triton.__version__} interpreter): bf16 tl.dot is wrong" if wrong else "fixed")
sys.exit(1 if wrong else 0)
