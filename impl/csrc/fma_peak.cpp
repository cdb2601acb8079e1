#include "fma_peak.h"

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <string>

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

#if defined(__AVX512F__)
constexpr int kWidth = 16;
inline float run_chains(int64_t iters, float seed) {
  __m512 a[kChains];
  for (int i = 0; i < kChains; ++i) a[i] = _mm512_set1_ps(seed + i);
  const __m512 m = _mm512_set1_ps(0.999999f), c = _mm512_set1_ps(1e-6f);
  for (int64_t n = 0; n < iters; ++n) {
#pragma GCC unroll 24  // every chain in its own register, not a load-FMA-store through memory
    for (int i = 0; i < kChains; ++i) a[i] = _mm512_fmadd_ps(a[i], m, c);
  }
  float sum = 0.f;
  for (int i = 0; i < kChains; ++i) sum += _mm512_reduce_add_ps(a[i]);
  return sum;
}
#elif defined(__FMA__)
constexpr int kWidth = 8;
inline float run_chains(int64_t iters, float seed) {
  __m256 a[kChains];
  for (int i = 0; i < kChains; ++i) a[i] = _mm256_set1_ps(seed + i);
  const __m256 m = _mm256_set1_ps(0.999999f), c = _mm256_set1_ps(1e-6f);
  for (int64_t n = 0; n < iters; ++n) {
#pragma GCC unroll 24
    for (int i = 0; i < kChains; ++i) a[i] = _mm256_fmadd_ps(a[i], m, c);
  }
  alignas(32) float lanes[8];
  float sum = 0.f;
  for (int i = 0; i < kChains; ++i) {
    _mm256_store_ps(lanes, a[i]);
    for (float x : lanes) sum += x;
  }
  return sum;
}
#else
constexpr int kWidth = 1;
inline float run_chains(int64_t iters, float seed) {
  float a[kChains];
  for (int i = 0; i < kChains; ++i) a[i] = seed + i;
  for (int64_t n = 0; n < iters; ++n) {
#pragma GCC unroll 24
    for (int i = 0; i < kChains; ++i) a[i] = fmadd(a[i], 0.999999f, 1e-6f);
  }
  float sum = 0.f;
  for (float x : a) sum += x;
  return sum;
}
#endif

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
  do {
    const auto t0 = std::chrono::steady_clock::now();
    parallel_for(threads, [&](int64_t t) {
      g_sink.fetch_add(float_to_bits(run_chains(iters, static_cast<float>(t))), std::memory_order_relaxed);
    });
    const double s = seconds_since(t0);
    best = std::max(best, 2.0 * kWidth * kChains * static_cast<double>(iters) * threads / s / 1e9);
    if (s < 0.02) iters *= 2;  // too short to time well: lengthen the next repeat
  } while (seconds_since(start) < seconds);
  return best;
}

}  // namespace pagecheck
