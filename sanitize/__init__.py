"""Sanitizer runs of the C++ core (`python -m sanitize {asan|tsan|fuzz}`).

| command                               | builds (incremental)                               | runs                                                        |
|---------------------------------------|----------------------------------------------------|-------------------------------------------------------------|
| `python -m sanitize asan`             | `_kernels` with ASan + UBSan, build/sanitize-asan  | the kernel-facing correctness catalog, the write path, tests/test_edges.py and the bounded tests/test_fuzz_boundary.py, under pytest |
| `python -m sanitize fuzz --seconds N` | the same build                                     | tests/test_fuzz_boundary.py for N seconds of random calls   |
| `python -m sanitize tsan`             | `thread_driver` with TSan, build/sanitize-tsan     | ctest: impl/csrc/tests/thread_driver.cpp (no Python in the process) |

A run fails when the tests fail or when any sanitizer report appears (in the output or
in the sanitizer log files). run.py documents the environment; tsan.supp the only
suppressions (MLX's Event, invisible to TSan because libmlx is not instrumented).
plugin.py (loaded with `-p sanitize.plugin`) refuses to run unless the sanitized module
and the runtime are really the ones loaded.
"""
