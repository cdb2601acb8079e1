"""Implementations for tests/test_plugin.py, loaded through `--impl tests.plugin_impls:NAME`.

`float64_oracle` is a correct implementation written another way (the NumPy float64
oracle behind the NumPy adapter): the catalog must pass it. Each entry of BROKEN breaks
one contract clause on purpose, by bending the arguments or the result of the built-in
kernel, and names the clause the catalog's failures must point at. None of these is
something the catalog knows about: it sees only a callable.

`float64_oracle_narrow`, `builtin_narrow`, `builtin_decode_only` and
`builtin_huge_extra_memory` (tests/test_declarations.py) are correct kernels with
narrow or demanding declarations: what they rule out must be skipped with the reason,
never drawn and filtered, never failed. `float64_oracle` declares none of contract v2
(each v2 check skipped with the reason); `float64_oracle_v2` is the same oracle
declaring all of it.

| name                        | the defect                                           | clause it breaks |
|-----------------------------|------------------------------------------------------|------------------|
| `round_robin_gqa`           | query head h reads KV head h % Hkv                   | gqa              |
| `window_one_too_many`       | a window of w sees w + 1 keys                         | window           |
| `logical_page_as_physical`  | logical page i read from physical page i              | addressing       |
| `causal_mask_ignored`       | every row sees the whole context                      | causal           |
| `empty_rows_not_zero`       | an empty slot (context 0) returns ones                | empty_row        |
| `output_always_float32`     | the output is not cast back to the query's dtype      | dtype            |
| `page_ids_clamped`          | out-of-pool page ids clamped instead of rejected      | reject.page_id   |
| `asserts_on_bad_input`      | bad input raises AssertionError, not a contract error | inv10            |
| `batch_dependent_bits`      | declares bitwise_batch, but bits depend on the batch  | inv6             |
| `sinks_ignored`             | declares sinks, drops the sink from the softmax (the float64 oracle otherwise) | sinks |
| `lse_base2_undeclared`      | returns a base-2 lse without declaring lse_convention="base2" | lse       |
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

import impl
from conformance.adapters import from_numpy
from oracles.numpy64 import attention_f64

float64_oracle = from_numpy(attention_f64, validates_input=False, bitwise_batch=True)
# the same oracle declaring a narrow kernel: float32 decode only (the rest must be skipped)
float64_oracle_decode_f32 = from_numpy(attention_f64, validates_input=False, dtypes=["float32"], prefill=False)
# ... declaring what a vLLM-CPU-like kernel computes (tests/test_declarations.py): the
# property checks must draw only these shapes, never filter them out
NARROW = {"dtypes": ["float32", "float16"], "head_dims": [32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256],
          "block_multiple": 16}
float64_oracle_narrow = from_numpy(attention_f64, validates_input=False, bitwise_batch=True, **NARROW)
# ... declaring every contract-v2 feature (REFERENCE.md 1b), which it computes
V2 = dict(softcap=True, alibi=True, sinks=True, lse=True, value_head_dim=True)
float64_oracle_v2 = from_numpy(attention_f64, validates_input=False, bitwise_batch=True, **V2)


def bad_capabilities(*args, **kwargs):
    """A callable whose declaration has a typo (for the usage-error test)."""
    return impl.paged_attention(*args, **kwargs)


bad_capabilities.pagecheck_capabilities = {"bitwise": True}


def _declaring(**capabilities):
    """The built-in kernel behind a foreign name with this declaration (it validates, so
    the rejection checks run; it reads the pools in place whatever extra_memory says)."""
    def paged_attention(*args, **kwargs):
        return impl.paged_attention(*args, **kwargs)

    paged_attention.pagecheck_capabilities = capabilities
    return paged_attention


# the narrow declaration on a validating kernel: the rejection checks draw from it too
builtin_narrow = _declaring(bitwise_batch=True, **NARROW)
# decode only: the context_short rejection (0 < context < L needs L >= 2) is ruled out everywhere
builtin_decode_only = _declaring(prefill=False)
# a kernel that says one call may allocate a million times its pools: the 4 GiB fixture never fits
builtin_huge_extra_memory = _declaring(extra_memory=1e6)


def _broken(clause: str, **capabilities):
    def wrap(fn):
        fn.pagecheck_capabilities = capabilities
        fn.breaks = clause
        return fn
    return wrap


@_broken("gqa")
def round_robin_gqa(query, key_pages, value_pages, block_table, context_lens, page_size, **kw):
    hq, hkv = query.shape[1], key_pages.shape[1]
    if hq % hkv:
        return impl.paged_attention(query, key_pages, value_pages, block_table, context_lens, page_size, **kw)
    group = hq // hkv
    # head h goes where the built-in's contiguous mapping reads KV head h % Hkv
    slot = [(h % hkv) * group + h // hkv for h in range(hq)]
    order = mx.array(np.argsort(slot))
    out = impl.paged_attention(query[:, order], key_pages, value_pages, block_table, context_lens, page_size, **kw)
    return out[:, mx.array(slot)]


@_broken("window")
def window_one_too_many(*args, window=None, **kw):
    return impl.paged_attention(*args, window=window + 1 if isinstance(window, int) and window >= 1 else window,
                                **kw)


@_broken("addressing")
def logical_page_as_physical(query, key_pages, value_pages, block_table, context_lens, page_size, **kw):
    if isinstance(block_table, mx.array) and block_table.ndim == 2 and block_table.dtype == mx.int32:
        rows, cols = block_table.shape
        logical = np.minimum(np.arange(cols, dtype=np.int32), max(key_pages.shape[0] - 1, 0))
        block_table = mx.array(np.broadcast_to(logical, (rows, cols)).copy())
    return impl.paged_attention(query, key_pages, value_pages, block_table, context_lens, page_size, **kw)


@_broken("causal")
def causal_mask_ignored(*args, mask="causal", window=None, **kw):
    if mask == "causal" and window is None:
        mask = None
    return impl.paged_attention(*args, mask=mask, window=window, **kw)


@_broken("empty_row")
def empty_rows_not_zero(query, key_pages, value_pages, block_table, context_lens, page_size, **kw):
    out = impl.paged_attention(query, key_pages, value_pages, block_table, context_lens, page_size, **kw)
    empty = (context_lens == 0)[:, None, None, None]
    return mx.where(empty, mx.ones_like(out), out)


@_broken("dtype")
def output_always_float32(*args, **kw):
    return impl.paged_attention(*args, **kw).astype(mx.float32)


@_broken("reject.page_id")
def page_ids_clamped(query, key_pages, value_pages, block_table, context_lens, page_size, **kw):
    if isinstance(block_table, mx.array) and block_table.dtype == mx.int32 and key_pages.ndim == 4:
        block_table = mx.clip(block_table, 0, max(key_pages.shape[0] - 1, 0))
    return impl.paged_attention(query, key_pages, value_pages, block_table, context_lens, page_size, **kw)


@_broken("inv10")
def asserts_on_bad_input(*args, **kw):
    try:
        return impl.paged_attention(*args, **kw)
    except impl.ContractViolation as e:
        raise AssertionError(str(e)) from None


@_broken("inv6", bitwise_batch=True)
def batch_dependent_bits(query, *args, **kw):
    out = impl.paged_attention(query, *args, **kw)
    if query.shape[0] == 1:
        return out
    # one unit in the last place, in the output's own dtype: within any tolerance, not bitwise
    ulp = {mx.float32: 2.0 ** -23, mx.float16: 2.0 ** -10, mx.bfloat16: 2.0 ** -7}[out.dtype]
    return (out.astype(mx.float32) * (1 + ulp)).astype(out.dtype)


# contract v2 (REFERENCE.md 1b), on the float64 oracle: it computes every feature

def _sinks_ignored(*args, sinks=None, **kw):
    return attention_f64(*args, **kw)


def _lse_base2(*args, **kw):
    result = attention_f64(*args, **kw)
    if isinstance(result, tuple):  # FlashInfer's log2-sum-exp, undeclared
        return result[0], result[1] / np.log(2.0)
    return result


sinks_ignored = from_numpy(_sinks_ignored, validates_input=False, **V2)
sinks_ignored.breaks = "sinks"
lse_base2_undeclared = from_numpy(_lse_base2, validates_input=False, **V2)
lse_base2_undeclared.breaks = "lse"

BROKEN = {name: fn.breaks for name, fn in globals().items() if callable(fn) and hasattr(fn, "breaks")}
