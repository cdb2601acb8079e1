"""`python -m conformance [--impl MODULE:ATTR] [--out DIR] [PYTEST_ARGS ...]`: the main job.

Runs the correctness catalog (`pytest -m correctness`) on the implementation (built-in by
default) and writes DIR/conformance.md, .html and .json (DIR: reports/), and for each
failed check a standalone reproduction DIR/repro/<check>.py (conformance/repro.py). Exit
status: pytest's (0 when every check passed or was skipped with a reason, 1 on any
failure, 4 on a usage error such as a bad --impl).
"""

from __future__ import annotations

import argparse
import sys

import pytest

from .report import ROOT


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conformance", description=__doc__.splitlines()[0])
    parser.add_argument("--impl", metavar="MODULE:ATTR", help="implementation to check (default: built-in)")
    parser.add_argument("--out", default=str(ROOT / "reports"), metavar="DIR", help="report directory")
    args, rest = parser.parse_known_args(argv)
    pytest_args = ["-m", "correctness", "--report-dir", args.out, *rest]
    if args.impl:
        pytest_args += ["--impl", args.impl]
    return int(pytest.main(pytest_args))


if __name__ == "__main__":
    sys.exit(main())
