"""The one error type of the operator contract.

Every rejection in REFERENCE.md section 1 raises `ContractViolation` before anything is
computed or written. `clause` is a stable id of the broken rule (tests and reports key
on it); the message names the offending argument, request or page.

| clause              | raised when                                                   |
|---------------------|---------------------------------------------------------------|
| `type`              | an argument is not an `mlx.core.array` / int / float          |
| `rank`              | an array has the wrong number of dimensions                   |
| `shape`             | shapes disagree (batch, query vs key head dim)                |
| `value_shape`       | value pages disagree with key pages outside the head dim (Dv may differ) |
| `dtype`             | query dtype unsupported, or pools differ from the query       |
| `metadata_dtype`    | `block_table` / `context_lens` not int32                      |
| `heads`             | `Hq % Hkv != 0`                                               |
| `page_size`         | page_size < 1 or disagreeing with `key_pages.shape[2]`        |
| `scale`             | scale not a finite number                                     |
| `mask`              | mask neither `"causal"` nor None                              |
| `window`            | window < 1, or a window without causal masking                |
| `softcap`           | soft-cap not a finite float32 number > 0                      |
| `alibi_slopes`      | ALiBi slopes not a float32 `[Hq]` array                       |
| `sinks`             | sinks not a float32 `[Hq]` array                              |
| `lse`               | `return_lse` not True or False                                |
| `kv_dtype`          | an unknown `kv_dtype`, or pages not holding its codes (uint8 fp8, int8) |
| `kv_scale`          | `k_scale` / `v_scale` not a float > 0 or a float32 `[]`, `[Hkv]` or `[P, Hkv, ps]` array, or given without a `kv_dtype` |
| `kv_layout`         | serving path: `kv_layout` neither None nor `"amx_packed"`, or packed pages that are not bfloat16 with page_size and head dim multiples of 32 and Dv = Dk |
| `merge`             | `merge_states` inputs of other shapes or dtypes than its contract |
| `context_negative`  | `context_lens[b] < 0`                                         |
| `context_short`     | `0 < context_lens[b] < L`                                     |
| `table_short`       | a request needs more pages than `max_pages`                   |
| `page_id`           | a page the request reads lies outside `[0, P)`                |
| `metadata_stale`    | prevalidated metadata used with other shapes than it was built for |
"""


class ContractViolation(ValueError):
    """Input that breaks the paged-attention operator contract."""

    def __init__(self, clause: str, message: str):
        super().__init__(message)
        self.clause = clause


class ServingError(ValueError):
    """Misuse of the page pool, a paged cache or the scheduler.

    Raised before any state changes: pool, caches and their K/V stay as they were.

    | clause           | raised when                                                   |
    |------------------|---------------------------------------------------------------|
    | `pool_exhausted` | fewer free pages than an allocation needs (`PoolExhausted`)    |
    | `already_free`   | freeing or sharing a free page, releasing twice (`PageAlreadyFree`) |
    | `page_id`        | a page id that is not an int in `[0, P)` (foreign page)        |
    | `capacity`       | a pool or cache size that is not a positive whole number of pages, or an append past a cache's `max_tokens` |
    | `layer`          | a layer index outside `[0, num_layers)`                        |
    | `slot`           | a write to a slot outside the pool, into a free page, or twice in one call |
    | `append_shape`   | new K/V rows whose shape does not fit the pool or the slots    |
    | `append_dtype`   | new K/V rows whose dtype differs from the pool's rows' dtype (`PagePool.dtype`) |
    | `kv_dtype`       | a pool's unknown `kv_dtype`, or a quantized pool's `fill` other than NaN or 0.0 |
    | `kv_scale`       | a pool's `scales` not tensor / head / token, or `k_scale` / `v_scale` of the wrong shape or dtype, not finite float32 values > 0, given for token scales or without a `kv_dtype` |
    | `kv_layout`      | a pool's `layout` neither None nor `"amx_packed"`, or packed without bfloat16 pages whose page_size and head_dim are multiples of 32 |
    | `shared_write`   | a raw write into a page other holders share (use the cache: it copies first) |
    | `released`       | using a paged cache after `release()`                         |
    | `request`        | a request id the scheduler does not know, or one given twice  |
    """

    def __init__(self, clause: str, message: str):
        super().__init__(message)
        self.clause = clause


class PoolExhausted(ServingError):
    """Not enough free pages; the pool and every cache are unchanged."""

    def __init__(self, message: str):
        super().__init__("pool_exhausted", message)


class PageAlreadyFree(ServingError):
    """A free page freed (or shared) again, or a cache released twice."""

    def __init__(self, message: str):
        super().__init__("already_free", message)
