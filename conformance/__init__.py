"""Check anyone's paged-attention kernel against the contract (REFERENCE.md sections 1 and 1b).

| module              | job                                                              |
|---------------------|------------------------------------------------------------------|
| `implementation.py` | `--impl MODULE:ATTR` -> the `Implementation` under test (built-in by default) |
| `capabilities.py`   | what an implementation declares it supports (contract-v2 features, quantized KV formats and scale granularities included); the rest is skipped with the reason |
| `bridges.py`        | `from_numpy`, `from_torch`, `from_mlx`: kernels of other frameworks / formats behind the mlx contract (torch gets fp8 pages in its own fp8 dtypes) |
| `formats/`          | KV layouts, page tables, query packing, window / lse / ALiBi conventions: one contract call as a native call |
| `clauses.py`        | the contract clauses checks point at                             |
| `repro.py`          | a failed check's last call as `reports/repro/<check>.py` + `.npz`, runnable alone |
| `plugin.py`         | the pytest plugin: options, fixtures, markers, the record of outcomes |
| `report.py`         | the conformance report: terminal, markdown, HTML                 |
| `__main__.py`       | `python -m conformance`: the main job                            |
"""

from .bridges import from_mlx, from_numpy, from_torch
from .capabilities import Capabilities
from .implementation import Implementation, UsageError, load

__all__ = ["Capabilities", "Implementation", "UsageError", "from_mlx", "from_numpy", "from_torch", "load"]
