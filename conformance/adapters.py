"""Kept for existing plug-ins: the bridges live in conformance/bridges.py."""

from .bridges import from_mlx, from_numpy, from_torch

__all__ = ["from_mlx", "from_numpy", "from_torch"]
