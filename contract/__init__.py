"""The one declarative description of a paged-attention call (REFERENCE.md section 1b).

`ScorePipeline` says how a query row's scores become its output: scale, mask, window,
soft-cap, ALiBi slopes, sinks, and whether the log-sum-exp is returned. Validation
(impl/validation.py), the oracles, the capabilities, the clauses and the report all
read this one object instead of loose keyword arguments threaded through each layer.
It holds no arithmetic: every reader computes from the fields on its own (the oracles
share no helper with impl/).
"""

from .pipeline import FEATURES, OPTIONS, ScorePipeline

__all__ = ["FEATURES", "OPTIONS", "ScorePipeline"]
