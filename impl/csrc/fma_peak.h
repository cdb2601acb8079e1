// The machine's multiply-add ceiling, for the benchmark report (bench/machine.py).
#pragma once

namespace pagecheck {

// GFLOP/s (2 per fused multiply-add lane) that the kernels' worker threads reach on
// independent multiply-add chains at the widest vector width this build uses (AVX-512,
// else AVX2, else scalar): the arithmetic limit a compute-bound kernel is judged
// against: the thread count times the fastest thread's rate (each thread times its own
// share, so a core busy with another job does not lower it). Best of the repeats that
// fit in `seconds`. Touches no attention state.
double fma_peak_gflops(double seconds);

}  // namespace pagecheck
