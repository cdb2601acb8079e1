// The value rules of the call's metadata (REFERENCE.md section 1), read in place.
//
// impl/validation.py names the fault; this only finds it. It reads the caller's MLX
// buffers where they lie (strided views included), with no host copy: the same rules
// as four NumPy passes over host copies cost ~10 us per call at B 1 on a quiet core,
// and 2-5x that right after a kernel call has emptied the caches (issue 22, point 4).
#pragma once

#include <cstdint>

#include "mlx/mlx.h"

namespace pagecheck {

namespace mx = mlx::core;

// The rule a request breaks; kMetadataOk when none does.
enum MetadataRule : int {
  kMetadataOk = 0,
  kContextNegative = 1,  // context_lens[b] < 0
  kContextShort = 2,     // 0 < context_lens[b] < query_len
  kTableShort = 3,       // context_lens[b] > max_pages * page_size
  kPageId = 4,           // a page request b reads lies outside [0, num_pages)
};

// The first offending request, in request order, with its first broken rule in the
// order above; for kPageId its first bad column among those it reads
// (column * page_size < context) and the id found there.
struct MetadataFault {
  int rule = kMetadataOk;
  int64_t request = 0;
  int32_t context = 0;
  int64_t column = 0;
  int32_t page = 0;
};

// block_table: int32 [B, max_pages]; context_lens: int32 [B] (both evaluated here when
// they are not yet). Throws std::invalid_argument for other dtypes or shapes, or
// page_size < 1: those are the Python layer's to reject first.
MetadataFault check_metadata(const mx::array& block_table, const mx::array& context_lens, int64_t page_size,
                             int64_t num_pages, int64_t query_len);

}  // namespace pagecheck
