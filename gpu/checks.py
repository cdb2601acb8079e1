"""The operator contract's rejections (REFERENCE.md 1, 1b) for torch tensors: the rules and
messages of impl/validation.py, checked in this order before anything is computed.

| argument            | TypeError unless   | ValueError unless                                            |
|---------------------|--------------------|--------------------------------------------------------------|
| the five arrays     | a torch.Tensor     | of rank 4, 4, 4, 2, 1; on the query's device                 |
| query               |                    | float32, float16 or bfloat16 `[B, Hq, L, Dk]`                |
| pools               |                    | the query's dtype (no quantized pages: none declared)        |
| metadata            |                    | int32                                                        |
| value_pages         |                    | key_pages' `[P, Hkv, ps]`, any head dim Dv >= 1              |
| key_pages           |                    | the query's head dim Dk >= 1                                 |
| metadata            |                    | B rows (`[B, max_pages]`, `[B]`)                             |
| heads               |                    | Hkv >= 1, Hq % Hkv == 0                                      |
| page_size           | an int             | >= 1, == key_pages.shape[2]                                  |
| scale               | None or a real     | a finite float32 value                                       |
| mask                |                    | "causal" or None                                             |
| window              | None or an int     | >= 1; mask="causal"; fits int32                              |
| softcap             | None or a real     | a finite float32 value > 0                                   |
| alibi_slopes, sinks | None or a tensor   | float32 `[Hq]` on the query's device (values not read)       |
| return_lse          | a bool             |                                                              |
| context_lens[b]     |                    | >= 0; 0 (an empty slot) or >= L; ceil(ctx / ps) <= max_pages |
| block_table[b, i]   |                    | in [0, P) for each page request b reads (i < ceil(ctx / ps)) |

A bool is never an int or a real here. The metadata's values are checked in one vectorized
pass on their device and one host read (the first offending request, its rule and the
numbers its message names): no loop over requests or pages.
"""

from __future__ import annotations

import numbers

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INT32_MAX = 2 ** 31 - 1
FLOAT32_MAX = torch.finfo(torch.float32).max


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _int(name, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return int(value)


def _finite32(name, value, what, positive=False) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be {what}, got {type(value).__name__} {value!r}")
    if not abs(value) <= FLOAT32_MAX or (positive and value <= 0):  # NaN, inf, past float32, <= 0
        raise ValueError(f"{name} must be a finite float32 value{' > 0' if positive else ''}, got {value!r}")


def _head_vector(name, x, q_heads, device):
    if x is None:
        return
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (float32 [Hq]), got {type(x).__name__}")
    if x.dtype != torch.float32:
        raise ValueError(f"{name} must be float32, got {_name(x.dtype)}")
    if tuple(x.shape) != (q_heads,):
        raise ValueError(f"{name} must have shape [Hq] = ({q_heads},), got {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device} but query is on {device}")


def check_call(query, key_pages, value_pages, block_table, context_lens, page_size, *, scale=None,
               mask="causal", window=None, softcap=None, alibi_slopes=None, sinks=None, return_lse=False):
    """Every rule of the module table, in its order; raises naming the argument and value."""
    arrays = {"query": (query, 4, "[B, Hq, L, Dk]"), "key_pages": (key_pages, 4, "[P, Hkv, page_size, Dk]"),
              "value_pages": (value_pages, 4, "[P, Hkv, page_size, Dv]"),
              "block_table": (block_table, 2, "[B, max_pages]"), "context_lens": (context_lens, 1, "[B]")}
    for name, (x, _, _) in arrays.items():
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    for name, (x, rank, layout) in arrays.items():
        if x.dim() != rank:
            raise ValueError(f"{name} must be {rank}-D {layout}; got shape {tuple(x.shape)}")
        if x.device != query.device:
            raise ValueError(f"{name} is on {x.device} but query is on {query.device}")
    if query.dtype not in FLOAT_DTYPES:
        raise ValueError(f"query dtype {_name(query.dtype)} is not supported (float32, float16, bfloat16)")
    for name, x in (("key_pages", key_pages), ("value_pages", value_pages)):
        if x.dtype != query.dtype:
            raise ValueError(f"{name} dtype {_name(x.dtype)} differs from query dtype {_name(query.dtype)} "
                             "(this kernel reads no quantized pages)")
    for name, x in (("block_table", block_table), ("context_lens", context_lens)):
        if x.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {_name(x.dtype)}")
    B, Hq, L, D = query.shape
    P, Hkv, slots, Dk = key_pages.shape
    if value_pages.shape[:3] != key_pages.shape[:3] or value_pages.shape[3] < 1:
        raise ValueError(f"value_pages shape {tuple(value_pages.shape)} differs from key_pages shape "
                         f"{tuple(key_pages.shape)} outside the head dim ([P, Hkv, page_size] must agree; "
                         "only Dv may differ from Dk)")
    if Dk != D or D < 1:
        raise ValueError(f"head dim differs: query D={D}, key_pages D={Dk}")
    for name, x in (("block_table", block_table), ("context_lens", context_lens)):
        if x.shape[0] != B:
            raise ValueError(f"{name} has {x.shape[0]} rows but query has B={B} requests")
    if Hkv < 1 or Hq % Hkv != 0:
        raise ValueError(f"Hq={Hq} is not a multiple of Hkv={Hkv}")
    page_size = _int("page_size", page_size)
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    if page_size != slots:
        raise ValueError(f"page_size={page_size} disagrees with key_pages.shape[2]={slots}")
    if scale is not None:
        _finite32("scale", scale, "a float")
    if not (mask is None or (isinstance(mask, str) and mask == "causal")):
        raise ValueError(f"mask must be 'causal' or None, got {mask!r}")
    if window is not None:
        window = _int("window", window)
        if window < 1:
            raise ValueError(f"window must be >= 1 or None, got {window}")
        if mask is None:
            raise ValueError(f"window={window} needs mask='causal' (got mask=None)")
        if window > INT32_MAX:
            raise ValueError(f"window={window} does not fit in int32")
    if softcap is not None:
        _finite32("softcap", softcap, "a float > 0 or None", positive=True)
    _head_vector("alibi_slopes", alibi_slopes, Hq, query.device)
    _head_vector("sinks", sinks, Hq, query.device)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be True or False, got {return_lse!r}")
    check_metadata_values(block_table, context_lens, page_size=page_size, num_pages=P, query_len=L)


def check_metadata_values(block_table, context_lens, *, page_size, num_pages, query_len) -> None:
    """The value rules in one pass on the device; one host read names the first offender."""
    B, max_pages = block_table.shape
    if B == 0:
        return
    ctx = context_lens.long()
    pages = (ctx.clamp(min=0) + page_size - 1) // page_size
    table = torch.nn.functional.pad(block_table, (0, 1))  # a spare column: no row is empty for argmax
    read = torch.arange(max_pages + 1, device=table.device) < pages.clamp(max=max_pages)[:, None]
    outside = read & ((table < 0) | (table >= num_pages))
    rules = torch.stack([ctx < 0, (ctx > 0) & (ctx < query_len), pages > max_pages, outside.any(1)], 1)
    failing = rules.any(1)
    b = failing.int().argmax()  # the first failing request (argmax: the first of equal maxima)
    i = outside[b].int().argmax()
    found, b, rule, n, need, i, page = torch.stack([failing[b].long(), b, rules[b].int().argmax().long(), ctx[b],
                                                     pages[b], i, table[b, i].long()]).tolist()  # the host read
    if found:
        raise ValueError(MESSAGES[rule].format(b=b, n=n, need=need, i=i, page=page, L=query_len, ps=page_size,
                                               max_pages=max_pages, P=num_pages))


MESSAGES = (  # the value rules, in check_metadata_values' order
    "context_lens[{b}] = {n} is negative",
    "context_lens[{b}] = {n} is shorter than the query length L={L}: a non-empty request holds its L new positions",
    "request {b} needs {need} pages (context {n}, page_size {ps}) but block_table rows hold max_pages={max_pages}",
    "block_table[{b}, {i}] = {page} is outside the pool [0, {P}) (request {b} reads logical page {i})",
)
