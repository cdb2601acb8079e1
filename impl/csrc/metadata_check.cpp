#include "metadata_check.h"

#include <cstdint>
#include <stdexcept>
#include <string>

namespace pagecheck {

namespace {

void require(bool ok, const char* what) {
  if (!ok) throw std::invalid_argument(std::string("pagecheck._kernels.check_metadata: ") + what);
}

}  // namespace

MetadataFault check_metadata(const mx::array& block_table, const mx::array& context_lens, int64_t page_size,
                             int64_t num_pages, int64_t query_len) {
  require(block_table.dtype() == mx::int32 && context_lens.dtype() == mx::int32, "metadata must be int32");
  require(block_table.ndim() == 2 && context_lens.ndim() == 1, "block_table must be 2-D and context_lens 1-D");
  require(block_table.shape(0) == context_lens.shape(0), "block_table and context_lens differ in rows");
  require(page_size >= 1, "page_size must be >= 1");
  mx::array table = block_table, lens = context_lens;  // handles: eval() fills the caller's arrays
  table.eval();
  lens.eval();
  const int64_t B = lens.shape(0), max_pages = table.shape(1);
  // Strides in elements; data() already points at a view's first element.
  const int32_t* ctx = lens.data<int32_t>();
  const int32_t* ids = table.data<int32_t>();
  const int64_t ctx_stride = lens.strides()[0], row_stride = table.strides()[0], col_stride = table.strides()[1];
  // PagedMetadata.build takes any page_size >= 1: a product past int64 saturates (no
  // int32 context exceeds it). j * page_size below cannot overflow: it is formed only
  // for j <= 1 or while (j - 1) * page_size < context < 2^31.
  int64_t capacity;
  if (__builtin_mul_overflow(max_pages, page_size, &capacity)) capacity = INT64_MAX;
  MetadataFault fault;
  for (int64_t b = 0; b < B; ++b) {
    const int32_t n = ctx[b * ctx_stride];
    fault.request = b;
    fault.context = n;
    if (n < 0) fault.rule = kContextNegative;
    else if (n > 0 && n < query_len) fault.rule = kContextShort;
    else if (n > capacity) fault.rule = kTableShort;
    if (fault.rule != kMetadataOk) return fault;
    const int32_t* row = ids + b * row_stride;
    // j < max_pages follows from the table_short rule; it is spelled out so that the
    // reads stay inside the row whatever becomes of that rule (its mutant included).
    for (int64_t j = 0; j < max_pages && j * page_size < n; ++j) {
      const int32_t page = row[j * col_stride];
      if (page < 0 || page >= num_pages) {
        fault.rule = kPageId;
        fault.column = j;
        fault.page = page;
        return fault;
      }
    }
  }
  return MetadataFault{};
}

}  // namespace pagecheck
