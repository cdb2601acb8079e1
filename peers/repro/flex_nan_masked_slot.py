"""torch 2.13 FlexAttention with PagedAttention (eager, CPU): NaN in a slot no query may
read poisons the rows.

One request of 5 keys in physical page 1 of a 3-page pool (page size 4): keys 0..3 fill
page 1, key 4 sits in slot 0 of page 2; page 0 is free. A one-token decode at position 4
sees keys 0..4 only. Three runs put NaN where nothing may be read: in the free page 0,
in the unused slots 1..3 of page 2 (past the request's length), and in V alone there.
Each must leave the output finite and equal to the clean run; here each turns it NaN:
the masked scores' weights are 0, and 0 * NaN = NaN in the weighted sum of V.

    python peers/repro/flex_nan_masked_slot.py   # needs torch (2.13.0 here)
Exit 1 while the defect is present, 0 once fixed.
"""

import sys
import warnings

import torch
from torch.nn.attention.experimental._paged_attention import PagedAttention
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

warnings.simplefilter("ignore")  # "flex_attention called without torch.compile"
P, ps, H, D, n = 3, 4, 2, 16, 5


def run(poison: str | None):
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(P, H, ps, D, generator=g), torch.randn(P, H, ps, D, generator=g)
    if poison == "free page":
        k[0], v[0] = float("nan"), float("nan")
    elif poison == "unused slots":
        k[2, :, 1:], v[2, :, 1:] = float("nan"), float("nan")
    elif poison == "unused V slots":
        v[2, :, 1:] = float("nan")
    q = torch.randn(1, H, 1, D, generator=g)
    paged = PagedAttention(P, ps, 1, device="cpu")
    paged.page_table[0, :2] = torch.tensor([1, 2])
    paged.physical_to_logical[0, torch.tensor([1, 2])] = torch.tensor([0, 1])
    kv_len = torch.tensor([n])
    logical = create_block_mask(lambda b, h, qi, kj: kj <= kv_len[b] - 1 + qi, 1, None, 1, 2 * ps, device="cpu",
                                BLOCK_SIZE=(128, ps))
    mask = paged.convert_logical_block_mask(logical, kv_len=kv_len)
    cache = lambda x: x.transpose(0, 1).reshape(1, H, P * ps, D)  # noqa: E731
    return flex_attention(q, cache(k), cache(v), block_mask=mask, scale=D ** -0.5)


clean = run(None)
assert torch.isfinite(clean).all()
bad = 0
for poison in ("free page", "unused slots", "unused V slots"):
    out = run(poison)
    nan = int(torch.isnan(out).sum())
    same = torch.equal(out, clean)
    print(f"NaN in the {poison}: {nan} of {out.numel()} outputs NaN; equal to the clean run: {same}")
    bad += not same
print("FAIL: slots no query may read reach the output" if bad else "PASS: unread slots never reach the output")
sys.exit(1 if bad else 0)
