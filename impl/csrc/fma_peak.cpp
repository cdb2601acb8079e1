#include "fma_peak.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <stdexcept>
#include <string>
#include <vector>

#include "numerics.h"
#include "thread_pool.h"

#if defined(__AVX512F__) || defined(__FMA__)
#include <immintrin.h>
#endif

namespace pagecheck {

namespace {

// Independent chains per thread: two FMA ports x 4 cycles of latency need 8; 24 leave
// room (and fit the 32 vector registers of AVX-512, the 16 of AVX2 spill a few).
constexpr int kChains = 24;

// The widest vector of the build, and the three operations the chains need.
#if defined(__AVX512F__)
using Vec = __m512;
constexpr int kWidth = 16;
inline Vec splat(float x) { return _mm512_set1_ps(x); }
inline Vec fma_vec(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float total(Vec v) { return _mm512_reduce_add_ps(v); }
#elif defined(__FMA__)
using Vec = __m256;
constexpr int kWidth = 8;
inline Vec splat(float x) { return _mm256_set1_ps(x); }
inline Vec fma_vec(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float total(Vec v) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, v);
  float sum = 0.f;
  for (float x : lanes) sum += x;
  return sum;
}
#else
using Vec = float;
constexpr int kWidth = 1;
inline Vec splat(float x) { return x; }
inline Vec fma_vec(Vec a, Vec b, Vec c) { return fmadd(a, b, c); }
inline float total(Vec v) { return v; }
#endif

inline float run_chains(int64_t iters, float seed) {
  Vec a[kChains];
  for (int i = 0; i < kChains; ++i) a[i] = splat(seed + i);
  const Vec m = splat(0.999999f), c = splat(1e-6f);
  for (int64_t n = 0; n < iters; ++n) {
#pragma GCC unroll 24  // every chain in its own register, not a load-FMA-store through memory
    for (int i = 0; i < kChains; ++i) a[i] = fma_vec(a[i], m, c);
  }
  float sum = 0.f;
  for (int i = 0; i < kChains; ++i) sum += total(a[i]);
  return sum;
}

// Where every chain's result goes, so that no compiler can drop the arithmetic.
std::atomic<uint32_t> g_sink{0};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

double fma_peak_gflops(double seconds) {
  if (!(seconds > 0.0) || seconds > 60.0) {
    throw std::invalid_argument("fma_peak_gflops: seconds must be in (0, 60], got " + std::to_string(seconds));
  }
  const int threads = num_threads();
  int64_t iters = 1 << 14;
  double best = 0.0;
  const auto start = std::chrono::steady_clock::now();
  // Each share is timed by the thread that runs it, and the ceiling is the fastest share's
  // rate times the thread count: timed as a whole, the call waits for its slowest thread,
  // so one core busy with another job (an xdist worker beside this one) halved the figure
  // on 2 cores (116.8 GFLOP/s against 233 quiet) and put it under a prefill whose dynamic
  // schedule had moved its work to the free core.
  std::vector<double> share_seconds(static_cast<size_t>(threads));
  do {
    parallel_for(threads, [&](int64_t t) {
      const auto t0 = std::chrono::steady_clock::now();
      g_sink.fetch_add(float_to_bits(run_chains(iters, static_cast<float>(t))), std::memory_order_relaxed);
      share_seconds[static_cast<size_t>(t)] = seconds_since(t0);
    });
    const double s = *std::min_element(share_seconds.begin(), share_seconds.end());
    best = std::max(best, 2.0 * kWidth * kChains * static_cast<double>(iters) * threads / s / 1e9);
    if (s < 0.02) iters *= 2;  // too short to time well: lengthen the next repeat
  } while (seconds_since(start) < seconds);
  return best;
}

}  // namespace pagecheck
