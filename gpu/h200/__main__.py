"""`python -m gpu.h200`: the run (or, with --memcheck-case, compute-sanitizer's case)."""

import sys

from gpu.h200.run import main

sys.exit(main())
