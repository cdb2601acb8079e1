// The buffer of a call's large output, kept when the array dies for the next call that
// needs one of the same size.
//
// MLX's CPU allocator takes buffers of 32 MiB and more from the system and gives them
// back when they are freed (malloc's mmap threshold), so without this every large call
// would fault its output in anew and Linux would zero it first: a causal f32 prefill at
// L = S = 2048 (32 MiB out, Hq 32, D 128) spent 1.5% of its time in clear_page, and took
// 0.955-0.965x of vLLM's time against 0.970-0.977x with its output reused (AMD, 2
// threads, in turns). One buffer is kept, of at most kMaxHeldBytes; a call of another
// size frees it. Every output element is written by the call (empty and unsafe batch
// slots included), so what a reused buffer held is never read.
#pragma once

#include <cstddef>
#include <cstdint>

#include "mlx/allocator.h"

namespace pagecheck {

constexpr size_t kMinCachedBytes = size_t{32} << 20;  // below: MLX's allocator reuses them
constexpr size_t kMaxHeldBytes = size_t{512} << 20;

// A buffer of `bytes` for an output: the one kept, where it has that size, else a new one
// (advised onto 2 MiB pages with `advise`, huge_pages.h). Its deleter keeps it for the
// next call when it has [kMinCachedBytes, kMaxHeldBytes] bytes and none is kept.
mlx::core::allocator::Data output_buffer(size_t bytes, bool advise);

struct OutputCacheStats {
  int64_t reused = 0;  // outputs given a kept buffer
  int64_t fresh = 0;   // outputs of cacheable size given a new one
  size_t held = 0;     // bytes kept now
};
OutputCacheStats output_cache_stats();
// Frees the kept buffer (the memory goes back to the system); returns its bytes.
size_t release_output_cache();

}  // namespace pagecheck
