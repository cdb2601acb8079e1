// The switch of the pair dot product loop (pair_dots.h, kernel_info.h).
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include "kernel_info.h"
#include "pair_dots.h"

namespace pagecheck {

namespace {

std::atomic<bool>& switched_on() {
  static std::atomic<bool> on{[] {
    if (!pair_dots_supported()) return false;
    const char* v = std::getenv("PAGECHECK_PAIR_DOTS");
    if (v != nullptr && (std::strcmp(v, "0") == 0 || std::strcmp(v, "1") == 0)) return v[0] == '1';
#if defined(__x86_64__)
    // Full rate only where vdpbf16ps issues as fast as an FMA (pair_dots.h).
    return __builtin_cpu_is("amd") != 0;
#else
    return false;
#endif
  }()};
  return on;
}

}  // namespace

bool pair_dots_supported() { return kPairDotsBuilt; }

bool pair_dots_enabled() { return switched_on().load(std::memory_order_relaxed); }

int64_t pair_dots_refusals() { return pair_refusals().load(std::memory_order_relaxed); }

void set_pair_dots(bool on) {
  if (on && !pair_dots_supported())
    throw std::invalid_argument("the pair dot product is not available here (this build has no AVX512-BF16)");
  switched_on().store(on, std::memory_order_relaxed);
}

}  // namespace pagecheck
