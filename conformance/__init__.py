"""Check anyone's paged-attention kernel against the contract (REFERENCE.md section 1).

| module              | job                                                              |
|---------------------|------------------------------------------------------------------|
| `implementation.py` | `--impl MODULE:ATTR` -> the `Implementation` under test (built-in by default) |
| `capabilities.py`   | what an implementation declares it supports; the rest is skipped with the reason |
| `adapters.py`       | `from_numpy`: a NumPy-in, NumPy-out kernel behind the mlx contract |
| `clauses.py`        | the contract clauses checks point at                             |
| `plugin.py`         | the pytest plugin: options, fixtures, markers, the record of outcomes |
| `report.py`         | the conformance report: terminal, markdown, HTML                 |
| `__main__.py`       | `python -m conformance`: the main job                            |
"""

from .adapters import from_numpy
from .capabilities import Capabilities
from .implementation import Implementation, UsageError, load

__all__ = ["Capabilities", "Implementation", "UsageError", "from_numpy", "load"]
