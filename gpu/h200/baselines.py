"""The baselines timed beside ours: FlexAttention with torch's PagedAttention, and torch SDPA."""

from __future__ import annotations

from gpu.h200.rows import Row


class Flex:
    """FlexAttention + torch's PagedAttention on the pool (peers/flex_attention.py's use), compiled on a GPU."""

    def __init__(self, torch, compiled: bool):
        self.torch, self.compiled = torch, compiled
        try:
            from torch.nn.attention import flex_attention as fa
            from torch.nn.attention.experimental import _paged_attention as pa
        except ImportError as e:
            self.absent = f"absent ({e})"
            return
        self.absent = None
        self.fa, self.pa = fa, pa
        if compiled:
            import torch._dynamo as dynamo

            for knob in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit",
                         "accumulated_cache_size_limit"):
                if hasattr(dynamo.config, knob):  # one compile per row: never fall back to eager silently
                    setattr(dynamo.config, knob, 4096)

    def prepare(self, row: Row, q, kp, vp, table, ctx, scale):
        torch, fa = self.torch, self.fa
        B, Hq, L, D = q.shape
        P, Hkv, ps, _ = kp.shape
        dev = q.device
        kc = kp.transpose(0, 1).reshape(1, Hkv, P * ps, D)  # heads first: a copy, made once, untimed
        vc = vp.transpose(0, 1).reshape(1, Hkv, P * ps, vp.shape[-1])
        kv_len = ctx.to(torch.int64)
        paged = self.pa.PagedAttention(P, ps, B, device=dev)
        n = -(-row.S // ps)
        for b in range(B):
            pages = table[b, :n].to(torch.int64)
            paged.page_table[b, :n] = pages
            paged.physical_to_logical[b, pages] = torch.arange(n, device=dev)

        def visible(b, h, q_idx, kv_idx):
            return kv_idx <= kv_len[b] - L + q_idx

        logical = fa.create_block_mask(visible, B, None, L, n * ps, device=dev, BLOCK_SIZE=(128, ps))
        physical = paged.convert_logical_block_mask(logical, kv_len=kv_len)
        if self.compiled:
            torch._dynamo.reset()  # each row compiles on its own: no guard pile-up across rows
            fn = torch.compile(fa.flex_attention, dynamic=False)
        else:
            fn = fa.flex_attention
        # prefill with small pages: the kernel's key block must divide the page (flex_decoding clamps it itself)
        opts = {"BLOCK_N": ps} if self.compiled and L > 1 and ps < 64 else None
        import warnings

        def call():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # eager flex warns it is not compiled
                return fn(q, kc, vc, block_mask=physical, scale=scale, enable_gqa=True, kernel_options=opts)

        return call, {"kernel_options": opts}


def sdpa_call(torch, q, kd, vd, scale, causal):
    F = torch.nn.functional
    try:
        F.scaled_dot_product_attention(q[:1, :, :1], kd[:1, :, :1], vd[:1, :, :1], scale=scale, enable_gqa=True)
        return (lambda: F.scaled_dot_product_attention(q, kd, vd, is_causal=causal, scale=scale, enable_gqa=True)), \
            "enable_gqa"
    except TypeError:  # an older torch: K/V repeated per query head (beforehand, untimed)
        G = q.shape[1] // kd.shape[1]
        kr, vr = kd.repeat_interleave(G, 1), vd.repeat_interleave(G, 1)
        return (lambda: F.scaled_dot_product_attention(q, kr, vr, is_causal=causal, scale=scale)), "repeat_interleave"
