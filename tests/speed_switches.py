"""The kernels' switches of speed (a loop chosen per machine, the same bits either way:
pagecheck_kernels.pair_dots_enabled, transposed_pairs_enabled), as a fresh process sees
them when the kernels load."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from peers import cpuinfo

ROOT = Path(__file__).resolve().parents[1]


def amd_cpu() -> bool:
    return cpuinfo("vendor_id") == "AuthenticAMD"


def cpu_family() -> int:
    """The CPU's display family as Linux reads it from cpuid (/proc/cpuinfo "cpu family":
    AMD's Zen 4 0x19, Zen 5 0x1A; Intel's cores 6)."""
    family = cpuinfo("cpu family")
    if family is None:
        raise LookupError("/proc/cpuinfo names no cpu family")
    return int(family)


def enabled_in_a_fresh_process(query: str, variable: str, value: str | None) -> bool:
    """pagecheck_kernels.<query>() in a new interpreter whose environment holds
    `variable` = `value` (left out where None)."""
    env = {k: v for k, v in os.environ.items() if k != variable}
    if value is not None:
        env[variable] = value
    code = f"import mlx.core, pagecheck_kernels as k; print(k.{query}())"
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    return out.stdout.strip() == "True"
