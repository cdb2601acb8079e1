"""What an implementation under test declares it supports.

An implementation may carry an attribute `pagecheck_capabilities` (a dict, so a kernel
author need not import pagecheck). Every key is optional; an unknown key is a usage error
(a typo must not silently widen or narrow the checks).

| key               | meaning                                                      | default (nothing declared) |
|-------------------|--------------------------------------------------------------|----------------------------|
| `dtypes`          | query dtypes it computes: subset of float32/float16/bfloat16 | all three                  |
| `head_dims`       | head dims it computes                                        | any                        |
| `page_sizes`      | page sizes it computes                                       | any                        |
| `prefill`         | L > 1 query rows per request                                 | True                       |
| `window`          | causal sliding window                                        | True                       |
| `unmasked`        | `mask=None`                                                  | True                       |
| `validates_input` | raises on every bad input of the contract's rejection list   | True                       |
| `error_types`     | exception classes that count as a contract error             | (ValueError, TypeError)    |
| `bitwise_batch`   | output bits independent of the batch, the slot, unread data and the prefill/decode split | False |
| `bitwise_threads` | output bits independent of the worker count (needs `set_num_threads`) | False             |
| `set_num_threads` | callable(n): sets the worker count                           | None                       |

A check a declaration rules out is skipped with the reason (and counted in the report);
an undeclared implementation runs the whole contract except the bitwise and thread checks.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

ALL_DTYPES = frozenset({"float32", "float16", "bfloat16"})


@dataclass(frozen=True)
class Capabilities:
    dtypes: frozenset = ALL_DTYPES
    head_dims: frozenset | None = None
    page_sizes: frozenset | None = None
    prefill: bool = True
    window: bool = True
    unmasked: bool = True
    validates_input: bool = True
    error_types: tuple = (ValueError, TypeError)
    bitwise_batch: bool = False
    bitwise_threads: bool = False
    set_num_threads: object = None

    @classmethod
    def declared(cls, spec: dict | None) -> Capabilities:
        """From a `pagecheck_capabilities` dict; raises ValueError naming a bad key or value."""
        if spec is None:
            return cls()
        if not isinstance(spec, dict):
            raise ValueError(f"pagecheck_capabilities must be a dict, got {type(spec).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(spec) - known)
        if unknown:
            raise ValueError(f"unknown capability {unknown[0]!r}; known: {', '.join(sorted(known))}")
        values = dict(spec)
        for key in ("dtypes", "head_dims", "page_sizes"):
            if values.get(key) is not None:
                values[key] = frozenset(values[key])
        bad = sorted(set(values.get("dtypes", ALL_DTYPES)) - ALL_DTYPES)
        if bad:
            raise ValueError(f"capability dtypes: {bad} not among {sorted(ALL_DTYPES)}")
        if "error_types" in values:
            types = tuple(values["error_types"]) if isinstance(values["error_types"], (list, tuple)) \
                else (values["error_types"],)
            if not types or not all(isinstance(t, type) and issubclass(t, Exception) for t in types):
                raise ValueError("capability error_types must be exception classes")
            values["error_types"] = types
        for key in ("prefill", "window", "unmasked", "validates_input", "bitwise_batch", "bitwise_threads"):
            if key in values and not isinstance(values[key], bool):
                raise ValueError(f"capability {key} must be True or False, got {values[key]!r}")
        caps = cls(**values)
        if caps.bitwise_threads and not callable(caps.set_num_threads):
            raise ValueError("capability bitwise_threads needs a callable set_num_threads")
        return caps

    def unsupported(self, *, dtype: str, head_dim: int, page_size: int, query_len: int,
                    mask, window) -> str | None:
        """Why a valid call with these features is outside the declaration, or None."""
        if dtype not in self.dtypes:
            return f"dtype {dtype} (declared dtypes: {', '.join(sorted(self.dtypes))})"
        if self.head_dims is not None and head_dim not in self.head_dims:
            return f"head dim {head_dim} (declared head_dims: {sorted(self.head_dims)})"
        if self.page_sizes is not None and page_size not in self.page_sizes:
            return f"page size {page_size} (declared page_sizes: {sorted(self.page_sizes)})"
        if query_len > 1 and not self.prefill:
            return f"L = {query_len} > 1 (declared prefill=False)"
        if mask is None and not self.unmasked:
            return "mask=None (declared unmasked=False)"
        if window is not None and not self.window:
            return "a sliding window (declared window=False)"
        return None

    def summary(self) -> dict:
        """JSON-friendly view for the report."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, frozenset):
                v = sorted(v)
            elif f.name == "error_types":
                v = [t.__name__ for t in v]
            elif f.name == "set_num_threads":
                v = v is not None
            out[f.name] = v
        return out
