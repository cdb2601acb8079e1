"""The one declarative description of a paged-attention call (REFERENCE.md section 1b).

`ScorePipeline` (its `kv` part a `KVFormat`: contract/kv_format.py) says how a query row's scores become its output: scale, mask, window,
soft-cap, ALiBi slopes, sinks, and whether the log-sum-exp is returned. Validation
(impl/validation.py), the oracles, the capabilities, the clauses and the report all
read this one object instead of loose keyword arguments threaded through each layer.
It holds no arithmetic: every reader computes from the fields on its own (the oracles
share no helper with impl/).
"""

from .kv_format import GRANULARITIES, KV_DTYPES, KVFormat, granularity_of, max_finite, storage_dtype
from .pipeline import FEATURES, OPTIONS, ScorePipeline

__all__ = ["FEATURES", "GRANULARITIES", "KV_DTYPES", "KVFormat", "OPTIONS", "ScorePipeline", "granularity_of",
           "max_finite", "storage_dtype"]
