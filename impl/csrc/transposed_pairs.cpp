// The switch of a prefill's transposed K blocks in pairs (transposed.h scores_transposed,
// transposed_walk.h score_transposed, kernel_info.h).
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include "kernel_info.h"

namespace pagecheck {

namespace {

#if defined(__AVX512F__)
constexpr bool kTransposedWalkBuilt = true;
#else
constexpr bool kTransposedWalkBuilt = false;
#endif

std::atomic<bool>& switched_on() {
  static std::atomic<bool> on{[] {
    if (!kTransposedWalkBuilt) return false;
    const char* v = std::getenv("PAGECHECK_TRANSPOSED_PAIRS");
    if (v != nullptr && (std::strcmp(v, "0") == 0 || std::strcmp(v, "1") == 0)) return v[0] == '1';
#if defined(__x86_64__)
    // Pairs pay where one block at a time is bound by its loads (Intel's two FMA ports),
    // not where the FMAs bound it (AMD's one 512-bit FMA a cycle): transposed.h.
    return __builtin_cpu_is("amd") == 0;
#else
    return true;
#endif
  }()};
  return on;
}

std::atomic<int64_t>& pairs_scored() {
  static std::atomic<int64_t> n{0};
  return n;
}

}  // namespace

int64_t transposed_pairs_scored() { return pairs_scored().load(std::memory_order_relaxed); }

void count_transposed_pairs(int64_t pairs) { pairs_scored().fetch_add(pairs, std::memory_order_relaxed); }

bool transposed_pairs_enabled() { return switched_on().load(std::memory_order_relaxed); }

void set_transposed_pairs(bool on) {
  if (on && !kTransposedWalkBuilt)
    throw std::invalid_argument("the transposed prefill walk is not in this build (no AVX-512)");
  switched_on().store(on, std::memory_order_relaxed);
}

}  // namespace pagecheck
