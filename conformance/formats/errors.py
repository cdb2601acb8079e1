"""The one error of the format layer."""

from __future__ import annotations

import pytest


class NotExpressible(pytest.skip.Exception):
    """A call the declared native format cannot express faithfully (a window below 1 in
    the flash convention, a negative context in CSR, a malformed array in any layout).

    It is pytest's skip outcome: the check that made the call is skipped with this reason
    and counted in the report, never passed, never failed on the kernel's account."""

    def __init__(self, reason: str):
        super().__init__(f"not expressible in the declared native format: {reason}", pytrace=False)
        self.reason = reason
