"""Compiled CPU kernels of pagecheck (built from impl/csrc by CMake).

Import `impl` rather than this package: `impl` validates the contract before calling in.
"""

import mlx.core  # noqa: F401  (loads libmlx.so before the extension needs it)

from ._kernels import *  # noqa: F401,F403
from ._kernels import __doc__  # noqa: F401
