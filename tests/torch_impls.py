"""torch kernels for tests/test_bridges.py (`--impl tests.torch_impls:NAME`; needs torch).

`nhd_varlen_flash` is tests/format_impls.py's float64 native reference behind
`from_torch`: it gets torch tensors in the NHD / varlen / flash format, computes on host
copies of them and returns a tensor of the query's dtype, as a torch kernel must (the
bridge casts nothing back unless `widens_to` is declared).
"""

from __future__ import annotations

import torch

from conformance.bridges import from_torch
from tests.format_impls import native_reference

FORMAT = dict(layout="nhd", query_packing="varlen", window_convention="flash")
_reference = native_reference(**FORMAT)


def _host(x):
    return x.float().numpy() if isinstance(x, torch.Tensor) and x.is_floating_point() else (
        x.numpy() if isinstance(x, torch.Tensor) else x)


def _nhd_varlen_flash(**kw):
    out = _reference(**{k: _host(v) for k, v in kw.items()})
    return torch.from_numpy(out).to(kw["query"].dtype)


nhd_varlen_flash = from_torch(_nhd_varlen_flash, device="cpu", validates_input=False, **FORMAT)
