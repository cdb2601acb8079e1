#include "huge_pages.h"

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
  return !now || madvise(range, last - first, kCollapse) == 0;
#else
  (void)data;
  (void)bytes;
  (void)now;
  return false;
#endif
}

}  // namespace pagecheck
