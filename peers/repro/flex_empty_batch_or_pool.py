"""torch 2.13 FlexAttention with PagedAttention (eager, CPU): an empty batch or an empty
pool crashes instead of returning an empty (or all-zero) result.

Both are valid in a serving loop between steps: a batch of 0 requests, and a pool of 0
pages where every request is an empty slot (context 0). With B = 0 the block mask's
construction or conversion raises (a reshape of 0 elements here; an IndexError inside
create_block_mask's vmap in the catalog's calls); with 0 pages `convert_logical_block_mask`
indexes into its 0-column page table and raises.

    python peers/repro/flex_empty_batch_or_pool.py   # needs torch (2.13.0 here)
Exit 1 while either crashes, 0 once both return.
"""

import sys
import warnings

import torch
from torch.nn.attention.experimental._paged_attention import PagedAttention
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

warnings.simplefilter("ignore")
H, D, ps = 2, 8, 4


def call(B: int, P: int):
    paged = PagedAttention(P, ps, max(B, 1), device="cpu")
    kv_len = torch.zeros(B, dtype=torch.int64)
    logical = create_block_mask(lambda b, h, qi, kj: kj < kv_len[b], B, None, 1, ps, device="cpu",
                                BLOCK_SIZE=(128, ps))
    mask = paged.convert_logical_block_mask(logical, kv_len=kv_len)
    cache = torch.zeros(1, H, P * ps, D)
    return flex_attention(torch.zeros(B, H, 1, D), cache, cache, block_mask=mask)


bad = 0
for what, B, P in (("an empty batch (B = 0)", 0, 2), ("every slot empty in a pool of 0 pages", 2, 0)):
    try:
        out = call(B, P)
        print(f"{what}: returned {tuple(out.shape)}")
    except Exception as e:  # noqa: BLE001 - the crash is the finding
        bad += 1
        print(f"{what}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
print("FAIL: valid empty inputs crash" if bad else "PASS: empty inputs return")
sys.exit(1 if bad else 0)
