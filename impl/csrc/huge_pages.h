// Large buffers on 2 MiB pages, where Linux allows: the kernels read scattered 64 KiB
// pages of a pool of gigabytes, and with 4 KiB pages each jump is a page walk.
#pragma once

#include <cstddef>

namespace pagecheck {

// Asks Linux to back the 2 MiB-aligned interior of [data, data + bytes) with 2 MiB pages
// (MADV_HUGEPAGE) and, with `now`, to move the pages already there onto them at once
// (MADV_COLLAPSE, Linux 6.1+). A hint: values never change. Returns whether it was
// taken (false: under two whole huge pages inside, not Linux, or refused).
bool huge_pages(void* data, size_t bytes, bool now);

}  // namespace pagecheck
