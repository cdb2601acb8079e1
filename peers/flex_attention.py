"""torch 2.13's FlexAttention with its PagedAttention page table (eager, on the CPU).

    pytest -m correctness --impl peers.flex_attention:paged_attention

Used as its docs show: the pool as one physical cache `[1, Hkv, P * ps, D]` (the pagecheck
pool, heads first, no copy of the data beyond the layout change), `PagedAttention`'s page
table and physical-to-logical map filled from each row's read pages (as `reserve` fills
them), a logical block mask with key blocks of `page_size` over the longest row's pages,
converted to physical pages by `convert_logical_block_mask(kv_len=seq_lens)`, then
`flex_attention` with `enable_gqa`. No torch.compile: the eager path is what runs here (about 50 ms a call).
Declared from measurements (peers/README.md): all three dtypes, any head dim and page
size; it validates no metadata, so validates_input=False.
"""

from __future__ import annotations

import warnings

from peers import need, version

torch = need("torch", "peers.flex_attention")
_flex = need("torch.nn.attention.flex_attention", "peers.flex_attention")
_paged = need("torch.nn.attention.experimental._paged_attention", "peers.flex_attention")
VERSION = version("torch")


def _table(block_table, kv_len, P: int, page_size: int):
    """PagedAttention's state for this batch as `reserve` leaves it: each row's read pages in
    its page table and their logical numbers in the physical-to-logical map."""
    paged = _paged.PagedAttention(P, page_size, block_table.shape[0], device="cpu")
    for b, n in enumerate((-(-kv_len // page_size)).tolist()):
        pages = block_table[b, :n].to(torch.int64)
        paged.page_table[b, :n] = pages
        paged.physical_to_logical[b, pages] = torch.arange(n)
    return paged


def flex_paged_attention(*, query, key_cache, value_cache, block_table, seq_lens, page_size, scale, causal,
                         window):
    B, Hq, L, D = query.shape
    P, Hkv = key_cache.shape[:2]
    cache = lambda pages: pages.transpose(0, 1).reshape(1, Hkv, P * page_size, D)  # noqa: E731
    kv_len = seq_lens.to(torch.int64)

    def visible(b, h, q_idx, kv_idx):
        pos = kv_len[b] - L + q_idx
        seen = kv_idx <= pos if causal else kv_idx >= 0
        return seen & (kv_idx > pos - window) if window is not None else seen

    paged = _table(block_table, kv_len, P, page_size)
    # the logical span a serving loop would build the mask over: the longest row's pages
    span = max(int(-(-kv_len.max() // page_size)) if B else 0, 1) * page_size
    logical = _flex.create_block_mask(visible, B, None, L, span, device="cpu", BLOCK_SIZE=(128, page_size))
    physical = paged.convert_logical_block_mask(logical, kv_len=kv_len)
    with warnings.catch_warnings():  # "flex_attention called without torch.compile": eager is the point here
        warnings.simplefilter("ignore", UserWarning)
        return _flex.flex_attention(query, cache(key_cache), cache(value_cache), block_mask=physical, scale=scale,
                                    enable_gqa=True)


CAPABILITIES = dict(layout="hnd", page_table="padded", query_packing="padded", window_convention="count",
                    validates_input=False, error_types=[RuntimeError, ValueError, IndexError])
LABEL = f"torch {VERSION} FlexAttention + PagedAttention (eager)"


def _bridge():
    from conformance.bridges import from_torch

    return from_torch(flex_paged_attention, device="cpu", **CAPABILITIES)


paged_attention = _bridge()
