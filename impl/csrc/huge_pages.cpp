#include "huge_pages.h"

#include <cerrno>
#include <cstdint>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace pagecheck {

bool huge_pages(void* data, size_t bytes, bool now) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  constexpr int kCollapse = 25;  // MADV_COLLAPSE, missing from older headers
  const uintptr_t start = reinterpret_cast<uintptr_t>(data);
  const uintptr_t first = (start + kHuge - 1) / kHuge * kHuge, last = (start + bytes) / kHuge * kHuge;
  if (last < first + 2 * kHuge) return false;  // a buffer this small gains next to nothing
  void* range = reinterpret_cast<void*>(first);
  if (madvise(range, last - first, MADV_HUGEPAGE) != 0) return false;
  if (!now) return true;
  // EAGAIN is Linux's "transient, try again" (a page it could not lock or compact this
  // time): the first pool built after a large pip install failed once that way here.
  for (int attempt = 0; attempt < 4; ++attempt) {
    if (madvise(range, last - first, kCollapse) == 0) return true;
    if (errno != EAGAIN) return false;
  }
  return false;
#else
  (void)data;
  (void)bytes;
  (void)now;
  return false;
#endif
}

}  // namespace pagecheck
