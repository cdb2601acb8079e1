"""The one error type of the operator contract.

Every rejection in REFERENCE.md section 1 raises `ContractViolation` before anything is
computed or written. `clause` is a stable id of the broken rule (tests and reports key
on it); the message names the offending argument, request or page.

| clause              | raised when                                                   |
|---------------------|---------------------------------------------------------------|
| `type`              | an argument is not an `mlx.core.array` / int / float          |
| `rank`              | an array has the wrong number of dimensions                   |
| `shape`             | shapes disagree (batch, head dim, value vs key pool)          |
| `dtype`             | query dtype unsupported, or pools differ from the query       |
| `metadata_dtype`    | `block_table` / `context_lens` not int32                      |
| `heads`             | `Hq % Hkv != 0`                                               |
| `page_size`         | page_size < 1 or disagreeing with `key_pages.shape[2]`        |
| `scale`             | scale not a finite number                                     |
| `mask`              | mask neither `"causal"` nor None                              |
| `window`            | window < 1, or a window without causal masking                |
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
