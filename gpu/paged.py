"""`paged_attention` on torch tensors through the Triton kernels (gpu/kernels.py).

    pytest -m correctness --impl gpu.paged:paged_attention        # on the CPU: TRITON_INTERPRET=1

The contract's signature and pagecheck's own layout (no format conversion), on torch
tensors of one device: CUDA, or the CPU under Triton's interpreter (`TRITON_INTERPRET=1`,
set by gpu/__init__.py when no GPU is visible and the variable is unset).

| argument        | meaning                                               | torch dtype / shape |
|-----------------|-------------------------------------------------------|---------------------|
| `query`         | the newest L positions of each request                | f32/f16/bf16 `[B, Hq, L, Dk]` |
| `key_pages`, `value_pages` | the page pools                             | query's dtype `[P, Hkv, ps, Dk]`, `[P, Hkv, ps, Dv]` |
| `block_table`   | request b, logical page i -> physical page            | int32 `[B, max_pages]` |
| `context_lens`  | valid positions of request b, the L new ones included | int32 `[B]` |
| options         | `scale, mask, window, softcap, alibi_slopes, sinks, return_lse` (contract/pipeline.py) | alibi_slopes, sinks: float32 `[Hq]` |
| returns         | out (and lse float32 `[B, Hq, L]`, natural log)       | query's dtype `[B, Hq, L, Dv]` |

Schedules: L <= `Schedule.decode_rows` runs the split-KV decode (a request's keys cut into
at most `max_splits` splits of at least `min_split` keys, from its own length) and the
merge; longer queries run the tiled prefill. Every call is checked first (gpu/checks.py:
the contract's rejection list, one host read of the metadata).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton

from . import kernels  # gpu/__init__.py chose the interpreter where no GPU is visible
from .checks import check_call


@dataclass(frozen=True)
class Schedule:
    """Tile sizes and the decode split rule (constants of a build, never of a batch)."""

    decode_rows: int = 8  # L at most this: split-KV decode
    min_split: int = 256  # keys a decode split holds at least
    max_splits: int = 16  # splits a request is cut into at most
    num_warps: int = 4

    # Tile sizes from gpu.compile's sm_90 build (registers, spills): 16-bit tiles run on
    # tensor cores; float32 asks tl.dot for IEEE products (no tf32), which run on the FMA
    # units with the tiles in registers: 64 x 64 float32 tiles spilled 11-42 KB a thread,
    # 32 x 16 (16 x 16 past D 128) none.
    def key_block(self, head_dim: int, dtype) -> int:
        if dtype == torch.float32:
            return 16
        return 64 if head_dim <= 128 else 32

    def row_block(self, head_dim: int, dtype) -> int:
        if dtype == torch.float32:
            return 32 if head_dim <= 128 else 16
        return 64 if head_dim <= 128 else 32

    def prefill_warps(self, head_dim: int, dtype) -> int:
        # 16-bit 64 x 64 tiles at D 128 held 238-254 of 255 registers a thread with 4 warps
        return 8 if dtype != torch.float32 and head_dim >= 128 else self.num_warps


DEFAULT = Schedule()


def _block(n: int) -> int:
    """A tile extent: a power of two, at least 16 (`tl.dot`'s least)."""
    return max(16, triton.next_power_of_2(n))


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class Launch:
    """One kernel launch of a call: what `attention` runs, and what gpu/compile.py compiles
    for a GPU target (the same arguments, so the variants compiled are the ones run)."""

    kernel: object
    grid: tuple
    args: dict  # the kernel's runtime arguments by name (tensors, ints, floats)
    meta: dict  # its constexprs by name
    num_warps: int
    num_stages: int = 1

    def run(self) -> None:
        self.kernel[self.grid](**self.args, **self.meta, num_warps=self.num_warps, num_stages=self.num_stages)


def plan(query, key_pages, value_pages, block_table, context_lens, *, scale, mask="causal", window=None,
         softcap=None, alibi_slopes=None, sinks=None, return_lse=False, schedule: Schedule = DEFAULT):
    """(out, lse, launches) of a checked call: the outputs allocated, the launches that fill them."""
    B, HQ, L, DK = query.shape
    P, HKV, PS, DV = value_pages.shape
    dev = query.device
    out = torch.empty((B, HQ, L, DV), dtype=query.dtype, device=dev)
    lse = torch.empty((B, HQ, L), dtype=torch.float32, device=dev)
    if B == 0 or L == 0:
        return out, lse, []
    query, key_pages, value_pages = (x if x.stride(-1) == 1 else x.contiguous()
                                     for x in (query, key_pages, value_pages))
    block_table, context_lens = block_table.contiguous(), context_lens.contiguous()
    # log2(e) folded into the scale once; with a soft-cap or ALiBi the scale comes first
    qk_log2 = kernels.LOG2E if softcap is not None or alibi_slopes is not None else float(scale) * kernels.LOG2E
    absent = context_lens  # the pointer of an absent option array (never read: its flag is off)
    block_n = schedule.key_block(max(DK, DV), query.dtype)
    pages = dict(K=key_pages, V=value_pages, BT=block_table, CTX=context_lens,
                 Slopes=absent if alibi_slopes is None else alibi_slopes.contiguous(), num_pages=P,
                 s_kp=key_pages.stride(0), s_kh=key_pages.stride(1), s_ks=key_pages.stride(2),
                 s_vp=value_pages.stride(0), s_vh=value_pages.stride(1), s_vs=value_pages.stride(2),
                 s_bt=block_table.stride(0), scale=float(scale), qk_log2=qk_log2, softcap=float(softcap or 0.0),
                 window=int(window or 0))
    queries = dict(Q=query, s_qb=query.stride(0), s_qh=query.stride(1), s_ql=query.stride(2))
    outputs = dict(O=out, LSE=lse, qk_log2=qk_log2, s_ob=out.stride(0), s_oh=out.stride(1), s_ol=out.stride(2),
                   Sinks=absent if sinks is None else sinks.contiguous())
    tiles = dict(HQ=HQ, G=HQ // HKV, PS=PS, DK=DK, DV=DV, BLOCK_N=block_n, BLOCK_DK=_block(DK),
                 BLOCK_DV=_block(DV), CAUSAL=mask == "causal", HAS_WINDOW=window is not None,
                 HAS_SOFTCAP=softcap is not None, HAS_ALIBI=alibi_slopes is not None,
                 DOT_F32=interpreting() and query.dtype == torch.bfloat16,  # triton #11584
                 PAGE_TILES=PS % block_n == 0)
    finish = dict(HAS_SINKS=sinks is not None, WRITE_LSE=bool(return_lse))
    if L > schedule.decode_rows:
        block_m = schedule.row_block(max(DK, DV), query.dtype)
        return out, lse, [Launch(kernels.prefill_kernel, (B, HQ, triton.cdiv(L, block_m)),
                                 {**queries, **pages, **outputs, "L": L},
                                 {**tiles, **finish, "BLOCK_M": block_m},
                                 schedule.prefill_warps(max(DK, DV), query.dtype), num_stages=2)]
    # split-KV decode: the grid holds the most splits any row of this table could need
    ns = max(1, min(schedule.max_splits, triton.cdiv(block_table.shape[1] * PS, schedule.min_split)))
    part_o = torch.empty((B, HQ, L, ns, DV), dtype=torch.float32, device=dev)
    part_m = torch.empty((B, HQ, L, ns), dtype=torch.float32, device=dev)
    part_l = torch.empty_like(part_m)
    parts = dict(OP=part_o, MP=part_m, LP=part_l, NS=ns)  # NS: a runtime int (no build per table width)
    decode = Launch(kernels.decode_split_kernel, (B, HKV, ns), {**queries, **pages, **parts},
                    {**tiles, "L": L, "MIN_SPLIT": schedule.min_split, "BLOCK_M": _block(HQ // HKV * L)},
                    schedule.num_warps)
    merge = Launch(kernels.merge_kernel, (B, HQ), {**parts, "CTX": context_lens, **outputs},
                   {"HQ": HQ, "L": L, "DV": DV, "BLOCK_DV": _block(DV), "BLOCK_L": triton.next_power_of_2(L),
                    "MIN_SPLIT": schedule.min_split, **finish}, schedule.num_warps)
    return out, lse, [decode, merge]


def attention(query, key_pages, value_pages, block_table, context_lens, page_size, *, scale=None,
              mask="causal", window=None, softcap=None, alibi_slopes=None, sinks=None, return_lse=False,
              schedule: Schedule = DEFAULT):
    """The operator (module docstring); `schedule` picks tile sizes and the split rule."""
    check_call(query, key_pages, value_pages, block_table, context_lens, page_size, scale=scale, mask=mask,
               window=window, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks, return_lse=return_lse)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    out, lse, launches = plan(query, key_pages, value_pages, block_table, context_lens, scale=scale, mask=mask,
                              window=window, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                              return_lse=return_lse, schedule=schedule)
    for launch in launches:
        launch.run()
    return (out, lse) if return_lse else out


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# What the kernels compute (pagecheck_capabilities): the whole contract and its score
# pipeline, in pagecheck's own layout. Not declared: bitwise_batch (a request's bits do not
# depend on the batch -- tests/test_gpu_kernels.py checks that bit for bit -- but the split
# decode and the tiled prefill sum in different orders, so a prefill's row is not the bits
# of the one-token decode at its position); quantized KV pages (not written yet).
CAPABILITIES = dict(dtypes=["float32", "float16", "bfloat16"], softcap=True, alibi=True, sinks=True, lse=True,
                    value_head_dim=True, error_types=[ValueError, TypeError])


def __getattr__(name):
    """`paged_attention`, built on first access: the bridge imports conformance and MLX,
    which `attention` and `plan` do not need (gpu/h200/ runs them on a GPU image)."""
    if name != "paged_attention":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from conformance.bridges import from_torch

    fn = from_torch(attention, device=DEVICE, **CAPABILITIES)
    globals()["paged_attention"] = fn
    return fn
