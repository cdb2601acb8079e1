// The switch of a prefill's transposed K blocks in pairs (transposed.h scores_transposed,
// transposed_walk.h score_transposed, kernel_info.h).
#include <atomic>
#include <cstdlib>
#if defined(__x86_64__)
#include <cpuid.h>
#endif
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
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (__get_cpuid(1, &eax, &ebx, &ecx, &edx) == 0) return true;
    unsigned family = (eax >> 8) & 0xF;  // the display family: base, plus extended where base is 0xF
    if (family == 0xF) family += (eax >> 20) & 0xFF;
    return transposed_pairs_pay(__builtin_cpu_is("amd") != 0, static_cast<int>(family));
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

// Pairs pay where one block at a time is bound by its loads: Intel's cores and AMD's Zen 5
// (family 0x1A), which issue two 512-bit FMAs and two 512-bit loads a cycle (fma_loops,
// one thread, Zen 5: 5.5 vector FMAs a ns one block at a time, 6.9 in pairs; prefill
// L = S = 2048 f32 11-17% faster). Not where the FMAs bound it: Zen 4 (family 0x19) runs a
// 512-bit FMA as two 256-bit halves, and there the pairs' pending sums in memory cost more
// than the broadcasts they save (3.4-3.6 against 2.9-3.3; prefill 5-8% slower in pairs).
// Zen 3 and older (0x19 and below) have no AVX-512, so no walk to choose.
bool transposed_pairs_pay(bool amd, int family) { return !amd || family > 0x19; }

int64_t transposed_pairs_scored() { return pairs_scored().load(std::memory_order_relaxed); }

void count_transposed_pairs(int64_t pairs) { pairs_scored().fetch_add(pairs, std::memory_order_relaxed); }

bool transposed_pairs_enabled() { return switched_on().load(std::memory_order_relaxed); }

void set_transposed_pairs(bool on) {
  if (on && !kTransposedWalkBuilt)
    throw std::invalid_argument("the transposed prefill walk is not in this build (no AVX-512)");
  switched_on().store(on, std::memory_order_relaxed);
}

}  // namespace pagecheck
