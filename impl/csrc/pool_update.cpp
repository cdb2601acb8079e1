#include "pool_update.h"

#include <atomic>
#include <cstring>
#include <stdexcept>
#include <string>

#include "aligned_array.h"
#include "mlx/backend/cpu/encoder.h"
#include "packed_layout.h"
#include "paged_attention.h"
#include "quantize.h"

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
  set_aligned_data(out);  // on cache lines, as impl.PagePool's pages
  g_pool_copies.fetch_add(1, std::memory_order_relaxed);
  return true;
}

// A row of a 16-bit pool into its packed slice (packed_layout.h): element by element,
// D scattered 2-byte stores (a decode step writes one row per KV head: negligible).
void scatter_packed(PageOrder order, int64_t D, int64_t off, const uint16_t* src, uint16_t* slice) {
  for (int64_t d = 0; d < D; ++d) slice[packed_index(order, off, d, D)] = src[d];
}

// `pool` is [P, Hkv, ps, D] with rows [T, Hkv, D], or token scales [P, Hkv, ps] with
// rows [T, Hkv] (a row of one element); `order` as write_slots.
void write_rows(mx::array& pool, const mx::array& rows, const mx::array& slots, PageOrder order) {
  const int64_t P = pool.shape(0), Hkv = pool.shape(1), ps = pool.shape(2);
  const int64_t D = pool.ndim() == 4 ? pool.shape(3) : 1, row = D * pool.itemsize();
  const int64_t* slot = slots.data<int64_t>();
  const char* src = rows.data<char>();
  char* dst = pool.data<char>();
  // One D-row per (token, head); the token's rows are adjacent in `rows`, strided by a
  // page's head block in the pool.
  for (int64_t t = 0; t < rows.shape(0); ++t) {
    if (slot[t] < 0 || slot[t] >= P * ps) continue;
    const int64_t page = slot[t] / ps, off = slot[t] % ps;
    for (int64_t h = 0; h < Hkv; ++h) {
      if (order == kRowOrder) {
        std::memcpy(dst + ((page * Hkv + h) * ps + off) * row, src + (t * Hkv + h) * row, row);
      } else {
        scatter_packed(order, D, off, reinterpret_cast<const uint16_t*>(src + (t * Hkv + h) * row),
                       reinterpret_cast<uint16_t*>(dst + (page * Hkv + h) * ps * row));
      }
    }
  }
}

// The scale of row (t, h): one per tensor ([]), per KV head ([Hkv]) or per row ([T, Hkv]).
struct RowScale {
  const float* data;
  int64_t t_stride, h_stride;
  explicit RowScale(const mx::array& a)
      : data(a.data<float>()), t_stride(a.ndim() == 2 ? a.shape(1) : 0), h_stride(a.ndim() >= 1 ? 1 : 0) {}
  float at(int64_t t, int64_t h) const { return data[t * t_stride + h * h_stride]; }
};

// rows (element type E) -> codes of C at their slots of `pool`, code = C::encode(x / s).
template <class E, class C>
void quantize_rows(mx::array& pool, const mx::array& rows, const mx::array& slots, const mx::array& scale) {
  const int64_t P = pool.shape(0), Hkv = pool.shape(1), ps = pool.shape(2), D = pool.shape(3);
  const int64_t* slot = slots.data<int64_t>();
  const typename E::T* src = rows.data<typename E::T>();
  typename C::T* dst = pool.data<typename C::T>();
  const RowScale s(scale);
  for (int64_t t = 0; t < rows.shape(0); ++t) {
    if (slot[t] < 0 || slot[t] >= P * ps) continue;
    const int64_t page = slot[t] / ps, off = slot[t] % ps;
    for (int64_t h = 0; h < Hkv; ++h) {
      const float sh = s.at(t, h);
      const typename E::T* x = src + (t * Hkv + h) * D;
      typename C::T* q = dst + ((page * Hkv + h) * ps + off) * D;
      for (int64_t d = 0; d < D; ++d) q[d] = C::encode(E::load(x[d]) / sh);
    }
  }
}

template <class C>
void quantize_rows_from(mx::array& pool, const mx::array& rows, const mx::array& slots, const mx::array& scale) {
  switch (rows.dtype()) {
    case mx::float32: quantize_rows<F32, C>(pool, rows, slots, scale); break;
    case mx::bfloat16: quantize_rows<BF16, C>(pool, rows, slots, scale); break;
    default: quantize_rows<F16, C>(pool, rows, slots, scale); break;
  }
}

void quantize_rows_as(int kv_code, mx::array& pool, const mx::array& rows, const mx::array& slots,
                      const mx::array& scale) {
  switch (kv_code) {
    case kKvFp8E4M3: quantize_rows_from<EncodeE4M3>(pool, rows, slots, scale); break;
    case kKvFp8E5M2: quantize_rows_from<EncodeE5M2>(pool, rows, slots, scale); break;
    default: quantize_rows_from<EncodeI8>(pool, rows, slots, scale); break;
  }
}

template <class E>
void scales_of_rows(const mx::array& rows, float max_finite, mx::array& out) {
  const int64_t rows_n = rows.shape(0) * rows.shape(1), D = rows.shape(2);
  const typename E::T* x = rows.data<typename E::T>();
  float* s = out.data<float>();
  for (int64_t r = 0; r < rows_n; ++r) s[r] = row_scale<E>(x + r * D, D, max_finite);
}

float max_finite_of(int kv_code) {
  return kv_code == kKvFp8E4M3 ? EncodeE4M3::kMax : kv_code == kKvFp8E5M2 ? EncodeE5M2::kMax : EncodeI8::kMax;
}

bool is_float_rows(mx::Dtype dt) { return dt == mx::float32 || dt == mx::float16 || dt == mx::bfloat16; }

bool is_quantized(int kv_code) { return kv_code >= kKvFp8E4M3 && kv_code <= kKvInt8; }

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

mx::array make(mx::Stream stream, PoolUpdate::Kind kind, std::vector<mx::array> inputs, int kv_code = 0,
               int order = kRowOrder) {
  const auto& pool = inputs[0];
  return mx::array(pool.shape(), pool.dtype(), std::make_shared<PoolUpdate>(stream, kind, kv_code, order),
                   std::move(inputs));
}

}  // namespace

int64_t pool_copies() { return g_pool_copies.load(std::memory_order_relaxed); }

mx::array write_slots(const mx::array& pages, const mx::array& rows, const mx::array& slots, int order,
                      mx::StreamOrDevice s) {
  const char* fn = "write_slots";
  require(pages.ndim() == 4, fn, "pages must be [P, Hkv, page_size, D]");
  require(rows.ndim() == 3 && rows.shape(1) == pages.shape(1) && rows.shape(2) == pages.shape(3),
          fn, "rows must be [T, Hkv, D] with the pool's heads and head dim");
  require(rows.dtype() == pages.dtype(), fn, "rows must have the pool's dtype");
  require(slots.ndim() == 1 && slots.dtype() == mx::int64 && slots.shape(0) == rows.shape(0), fn,
          "slots must be int64 [T]");
  require(order >= kRowOrder && order <= kPackedValueOrder, fn, "order must be 0 (rows), 1 (packed keys) or 2 "
          "(packed values)");
  require(order == kRowOrder || (pages.itemsize() == 2 && packed_fits(pages.shape(2), pages.shape(3))), fn,
          "a packed pool holds 16-bit elements with page_size and D multiples of 32");
  auto stream = mx::to_stream(s);
  // The pool goes in as it is: wrapping it (mx::contiguous) would add a reference and
  // defeat donation. take_over() rejects a non-contiguous pool instead.
  return make(stream, PoolUpdate::Kind::WriteSlots,
              {pages, mx::contiguous(rows, false, stream), mx::contiguous(slots, false, stream)}, 0, order);
}

mx::array copy_pages(const mx::array& pages, const mx::array& src, const mx::array& dst,
                     mx::StreamOrDevice s) {
  const char* fn = "copy_pages";
  require(pages.ndim() == 4 || pages.ndim() == 3, fn,
          "pages must be [P, Hkv, page_size, D] (or token scales [P, Hkv, page_size])");
  require(src.ndim() == 1 && src.dtype() == mx::int32 && dst.shape() == src.shape() &&
              dst.dtype() == mx::int32,
          fn, "src and dst must be int32 [n]");
  auto stream = mx::to_stream(s);
  return make(stream, PoolUpdate::Kind::CopyPages,
              {pages, mx::contiguous(src, false, stream), mx::contiguous(dst, false, stream)});
}

mx::array quantize_slots(const mx::array& pages, const mx::array& rows, const mx::array& slots,
                         const mx::array& scale, int kv_code, mx::StreamOrDevice s) {
  const char* fn = "quantize_slots";
  require(is_quantized(kv_code), fn, "kv_code must be 1 (e4m3), 2 (e5m2) or 3 (int8)");
  require(pages.ndim() == 4, fn, "pages must be [P, Hkv, page_size, D]");
  require(pages.dtype() == (kv_code == kKvInt8 ? mx::int8 : mx::uint8), fn,
          "pages must hold the codes of kv_code (uint8 fp8, int8)");
  require(rows.ndim() == 3 && rows.shape(1) == pages.shape(1) && rows.shape(2) == pages.shape(3),
          fn, "rows must be [T, Hkv, D] with the pool's heads and head dim");
  require(is_float_rows(rows.dtype()), fn, "rows must be float32, float16 or bfloat16");
  require(slots.ndim() == 1 && slots.dtype() == mx::int64 && slots.shape(0) == rows.shape(0), fn,
          "slots must be int64 [T]");
  const bool shaped = scale.ndim() == 0 || (scale.ndim() == 1 && scale.shape(0) == pages.shape(1)) ||
                      (scale.ndim() == 2 && scale.shape(0) == rows.shape(0) && scale.shape(1) == pages.shape(1));
  require(scale.dtype() == mx::float32 && shaped, fn, "scale must be float32 [], [Hkv] or [T, Hkv]");
  auto stream = mx::to_stream(s);
  return make(stream, PoolUpdate::Kind::QuantizeSlots,
              {pages, mx::contiguous(rows, false, stream), mx::contiguous(slots, false, stream),
               mx::contiguous(scale, false, stream)},
              kv_code);
}

mx::array row_scales(const mx::array& rows, int kv_code, mx::StreamOrDevice s) {
  const char* fn = "row_scales";
  require(is_quantized(kv_code), fn, "kv_code must be 1 (e4m3), 2 (e5m2) or 3 (int8)");
  require(rows.ndim() == 3 && is_float_rows(rows.dtype()), fn, "rows must be float32 / float16 / bfloat16 [T, Hkv, D]");
  auto stream = mx::to_stream(s);
  return mx::array({rows.shape(0), rows.shape(1)}, mx::float32, std::make_shared<RowScales>(stream, kv_code),
                   {mx::contiguous(rows, false, stream)});
}

mx::array write_scales(const mx::array& scales, const mx::array& scale, const mx::array& slots,
                       mx::StreamOrDevice s) {
  const char* fn = "write_scales";
  require(scales.ndim() == 3 && scales.dtype() == mx::float32, fn, "scales must be float32 [P, Hkv, page_size]");
  require(scale.ndim() == 2 && scale.dtype() == mx::float32 && scale.shape(1) == scales.shape(1), fn,
          "scale must be float32 [T, Hkv] with the pool's heads");
  require(slots.ndim() == 1 && slots.dtype() == mx::int64 && slots.shape(0) == scale.shape(0), fn,
          "slots must be int64 [T]");
  auto stream = mx::to_stream(s);
  return make(stream, PoolUpdate::Kind::WriteSlots,
              {scales, mx::contiguous(scale, false, stream), mx::contiguous(slots, false, stream)});
}

void PoolUpdate::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const bool copy = take_over(inputs[0], out);
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& a : inputs) encoder.set_input_array(a);
  encoder.set_output_array(out);
  // Quantizing writes carry a fourth input (the scales); the others have three.
  const auto& scale = inputs.size() > 3 ? inputs[3] : inputs[0];
  encoder.dispatch([kind = kind_, kv_code = kv_code_, order = static_cast<PageOrder>(order_), copy, pool = mx::array::unsafe_weak_copy(inputs[0]),
                    a = mx::array::unsafe_weak_copy(inputs[1]),
                    b = mx::array::unsafe_weak_copy(inputs[2]),
                    sc = mx::array::unsafe_weak_copy(scale),
                    out = mx::array::unsafe_weak_copy(out)]() mutable {
    if (copy) std::memcpy(out.data<char>(), pool.data<char>(), pool.nbytes());
    switch (kind) {
      case Kind::WriteSlots: write_rows(out, a, b, order); break;
      case Kind::CopyPages: copy_whole_pages(out, a, b); break;
      case Kind::QuantizeSlots: quantize_rows_as(kv_code, out, a, b, sc); break;
    }
  });
}

void PoolUpdate::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("pagecheck: pool updates have no GPU kernel in this build (CPU only)");
}

void RowScales::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  encoder.set_input_array(inputs[0]);
  encoder.set_output_array(out);
  encoder.dispatch([max_finite = max_finite_of(kv_code_), rows = mx::array::unsafe_weak_copy(inputs[0]),
                    out = mx::array::unsafe_weak_copy(out)]() mutable {
    switch (rows.dtype()) {
      case mx::float32: scales_of_rows<F32>(rows, max_finite, out); break;
      case mx::bfloat16: scales_of_rows<BF16>(rows, max_finite, out); break;
      default: scales_of_rows<F16>(rows, max_finite, out); break;
    }
  });
}

void RowScales::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::runtime_error("pagecheck: row scales have no GPU kernel in this build (CPU only)");
}

}  // namespace pagecheck
