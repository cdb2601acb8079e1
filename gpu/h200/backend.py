"""torch and the Triton wrapper, imported with the environment set first (the interpreter
where there is no GPU, or on a dry run)."""

from __future__ import annotations

import os


def import_torch(dry_run: bool):
    if dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (gpu.paged sets it only without CUDA)
    import torch

    cuda = torch.cuda.is_available() and not dry_run
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return torch, cuda


def import_paged(notes: list):
    """gpu.paged (its conformance bridge, which needs MLX, is built only on first access)."""
    import gpu.paged as paged

    return paged
