#include "output_cache.h"

#include <mutex>
#include <utility>

#include "huge_pages.h"

namespace pagecheck {

namespace mx = mlx::core;

namespace {

// Made once and never freed: the buffer kept at exit stays with the process instead of
// going back to an allocator that may be gone by then.
struct Held {
  std::mutex lock;
  mx::allocator::Buffer buffer{nullptr};
  size_t bytes = 0;
  OutputCacheStats stats;
};
Held& held() {
  static Held* h = new Held();
  return *h;
}

bool cacheable(size_t bytes) { return bytes >= kMinCachedBytes && bytes <= kMaxHeldBytes; }

// The deleter of a cacheable output: kept when nothing is, else freed.
void give_back(mx::allocator::Buffer buffer, size_t bytes) {
  Held& h = held();
  {
    std::lock_guard<std::mutex> guard(h.lock);
    if (h.buffer.ptr() == nullptr) {
      h.buffer = buffer;
      h.bytes = bytes;
      return;
    }
  }
  mx::allocator::allocator().free(buffer);
}

// Takes the kept buffer where it has `bytes`; frees one of another size.
mx::allocator::Buffer take(size_t bytes) {
  Held& h = held();
  mx::allocator::Buffer other{nullptr};
  {
    std::lock_guard<std::mutex> guard(h.lock);
    mx::allocator::Buffer kept = std::exchange(h.buffer, mx::allocator::Buffer{nullptr});
    if (kept.ptr() != nullptr && h.bytes == bytes) {
      ++h.stats.reused;
      return kept;
    }
    other = kept;
    ++h.stats.fresh;
  }
  if (other.ptr() != nullptr) mx::allocator::allocator().free(other);
  return mx::allocator::Buffer{nullptr};
}

}  // namespace

mx::allocator::Data output_buffer(size_t bytes, bool advise) {
  if (!cacheable(bytes)) {
    mx::allocator::Data data = mx::allocator::malloc(bytes);
    if (advise) huge_pages(data.buffer().raw_ptr(), bytes, /*now=*/false);
    return data;
  }
  mx::allocator::Buffer buffer = take(bytes);
  if (buffer.ptr() == nullptr) {
    buffer = mx::allocator::allocator().malloc(bytes);
    if (advise) huge_pages(buffer.raw_ptr(), bytes, /*now=*/false);
  }
  return mx::allocator::Data(buffer, [bytes](mx::allocator::Buffer b) { give_back(b, bytes); });
}

OutputCacheStats output_cache_stats() {
  Held& h = held();
  std::lock_guard<std::mutex> guard(h.lock);
  OutputCacheStats s = h.stats;
  s.held = h.buffer.ptr() != nullptr ? h.bytes : 0;
  return s;
}

size_t release_output_cache() {
  Held& h = held();
  mx::allocator::Buffer kept{nullptr};
  size_t bytes = 0;
  {
    std::lock_guard<std::mutex> guard(h.lock);
    kept = std::exchange(h.buffer, mx::allocator::Buffer{nullptr});
    bytes = kept.ptr() != nullptr ? h.bytes : 0;
  }
  if (kept.ptr() != nullptr) mx::allocator::allocator().free(kept);
  return bytes;
}

}  // namespace pagecheck
