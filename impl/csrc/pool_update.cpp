#include "pool_update.h"

#include <atomic>
#include <cstring>
#include <stdexcept>
#include <string>

#include "mlx/backend/cpu/encoder.h"

namespace pagecheck {

namespace {

std::atomic<int64_t> g_pool_copies{0};

void require(bool ok, const char* fn, const char* what) {
  if (!ok) throw std::invalid_argument(std::string("pagecheck._kernels.") + fn + ": " + what);
}

// Gives `out` the pool's storage: the pool's own buffer when donatable, else a fresh
// one that the dispatched task fills with a copy. Decided here, while the graph still
// holds the pool; returns whether the copy is needed.
bool take_over(const mx::array& pool, mx::array& out) {
  if (!pool.flags().row_contiguous) {
    throw std::invalid_argument("pagecheck: a page pool must be row-contiguous");
  }
  if (pool.is_donatable()) {
    out.copy_shared_buffer(pool);
    return false;
  }
  out.set_data(mx::allocator::malloc(out.nbytes()));
  g_pool_copies.fetch_add(1, std::memory_order_relaxed);
  return true;
}

void write_rows(mx::array& pool, const mx::array& rows, const mx::array& slots) {
  const int64_t P = pool.shape(0), Hkv = pool.shape(1), ps = pool.shape(2);
  const int64_t row = pool.shape(3) * pool.itemsize();
  const int64_t* slot = slots.data<int64_t>();
  const char* src = rows.data<char>();
  char* dst = pool.data<char>();
  // One D-row per (token, head); the token's rows are adjacent in `rows`, strided by a
  // page's head block in the pool.
  for (int64_t t = 0; t < rows.shape(0); ++t) {
    if (slot[t] < 0 || slot[t] >= P * ps) continue;
    const int64_t page = slot[t] / ps, off = slot[t] % ps;
    for (int64_t h = 0; h < Hkv; ++h) {
      std::memcpy(dst + ((page * Hkv + h) * ps + off) * row, src + (t * Hkv + h) * row, row);
    }
  }
}

void copy_whole_pages(mx::array& pool, const mx::array& src, const mx::array& dst) {
  const int64_t P = pool.shape(0);
  if (P == 0) return;
  const int64_t page_bytes = pool.nbytes() / P;  // a page is one contiguous [Hkv, ps, D] block
  const int32_t* s = src.data<int32_t>();
  const int32_t* d = dst.data<int32_t>();
  char* data = pool.data<char>();
  for (int64_t i = 0; i < src.shape(0); ++i) {
    if (s[i] < 0 || s[i] >= P || d[i] < 0 || d[i] >= P || s[i] == d[i]) continue;
    std::memcpy(data + d[i] * page_bytes, data + s[i] * page_bytes, page_bytes);
  }
}

mx::array make(mx::Stream stream, PoolUpdate::Kind kind, std::vector<mx::array> inputs) {
  const auto& pool = inputs[0];
  return mx::array(pool.shape(), pool.dtype(), std::make_shared<PoolUpdate>(stream, kind),
                   std::move(inputs));
}

}  // namespace

int64_t pool_copies() { return g_pool_copies.load(std::memory_order_relaxed); }

mx::array write_slots(const mx::array& pages, const mx::array& rows, const mx::array& slots,
                      mx::StreamOrDevice s) {
  const char* fn = "write_slots";
  require(pages.ndim() == 4, fn, "pages must be [P, Hkv, page_size, D]");
  require(rows.ndim() == 3 && rows.shape(1) == pages.shape(1) && rows.shape(2) == pages.shape(3),
          fn, "rows must be [T, Hkv, D] with the pool's heads and head dim");
  require(rows.dtype() == pages.dtype(), fn, "rows must have the pool's dtype");
  require(slots.ndim() == 1 && slots.dtype() == mx::int64 && slots.shape(0) == rows.shape(0), fn,
          "slots must be int64 [T]");
  auto stream = mx::to_stream(s);
  // The pool goes in as it is: wrapping it (mx::contiguous) would add a reference and
  // defeat donation. take_over() rejects a non-contiguous pool instead.
  return make(stream, PoolUpdate::Kind::WriteSlots,
              {pages, mx::contiguous(rows, false, stream), mx::contiguous(slots, false, stream)});
}

mx::array copy_pages(const mx::array& pages, const mx::array& src, const mx::array& dst,
                     mx::StreamOrDevice s) {
  const char* fn = "copy_pages";
  require(pages.ndim() == 4, fn, "pages must be [P, Hkv, page_size, D]");
  require(src.ndim() == 1 && src.dtype() == mx::int32 && dst.shape() == src.shape() &&
              dst.dtype() == mx::int32,
          fn, "src and dst must be int32 [n]");
  auto stream = mx::to_stream(s);
  return make(stream, PoolUpdate::Kind::CopyPages,
              {pages, mx::contiguous(src, false, stream), mx::contiguous(dst, false, stream)});
}

void PoolUpdate::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const bool copy = take_over(inputs[0], out);
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& a : inputs) encoder.set_input_array(a);
  encoder.set_output_array(out);
  encoder.dispatch([kind = kind_, copy, pool = mx::array::unsafe_weak_copy(inputs[0]),
                    a = mx::array::unsafe_weak_copy(inputs[1]),
                    b = mx::array::unsafe_weak_copy(inputs[2]),
                    out = mx::array::unsafe_weak_copy(out)]() mutable {
    if (copy) std::memcpy(out.data<char>(), pool.data<char>(), pool.nbytes());
    if (kind == Kind::WriteSlots) {
      write_rows(out, a, b);
    } else {
      copy_whole_pages(out, a, b);
    }
  });
}

void PoolUpdate::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("pagecheck: pool updates have no GPU kernel in this build (CPU only)");
}

}  // namespace pagecheck
