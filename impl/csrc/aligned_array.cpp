#include "aligned_array.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>

#include "mlx/allocator.h"
#include "mlx/backend/common/utils.h"
#include "mlx/ops.h"

namespace pagecheck {

namespace mx = mlx::core;

namespace {

// Elements from the start of `block`'s data to the first line boundary in it. MLX's
// buffers start at least 8-byte aligned, so the bytes are a whole number of elements of
// every page dtype (1, 2 or 4 bytes).
int64_t skip_to_line(const mx::array& block) {
  const auto at = reinterpret_cast<uintptr_t>(block.data<char>());
  return static_cast<int64_t>((kLineBytes - at % kLineBytes) % kLineBytes / block.itemsize());
}

}  // namespace

void set_aligned_data(mx::array& out) {
  // The buffer's holder has one element: only its data is shared, and MLX's axes are
  // int32, too short to count the elements of a large pool in one.
  const mx::array block(mx::allocator::malloc(out.nbytes() + kLineBytes), mx::Shape{1}, out.dtype());
  // The strides and flags set_data gives a row-contiguous array of this shape.
  mx::array::Flags flags{};
  flags.contiguous = flags.row_contiguous = true;
  flags.col_contiguous = out.size() <= 1 || out.size() == static_cast<size_t>(*std::max_element(
                                                               out.shape().begin(), out.shape().end()));
  out.copy_shared_buffer(block, mx::make_contiguous_strides(out.shape()), flags, out.size(), skip_to_line(block));
}

namespace {

// An array of `shape` and `dtype` made here, not computed (no primitive), evaluated, its
// data on a line and not yet written.
mx::array aligned_empty(const mx::Shape& shape, mx::Dtype dtype) {
  mx::array out(shape, dtype, nullptr, {});
  set_aligned_data(out);
  out.set_status(mx::array::Status::available);
  return out;
}

template <class Word>
void fill_words(void* data, size_t n, const void* bits) {
  Word w;
  std::memcpy(&w, bits, sizeof(Word));
  std::fill_n(static_cast<Word*>(data), n, w);
}

}  // namespace

mx::array aligned_full(const mx::Shape& shape, const mx::array& value) {
  if (value.size() != 1) throw std::invalid_argument("aligned_full: the value must have one element");
  size_t n = 1;
  for (int d : shape) {
    if (d < 0) throw std::invalid_argument("aligned_full: negative dimension");
    n *= static_cast<size_t>(d);
  }
  if (n == 0) throw std::invalid_argument("aligned_full: the shape has no elements");
  mx::array v = mx::contiguous(value, /*allow_col_major=*/false, mx::Device::cpu);
  v.eval();
  mx::array out = aligned_empty(shape, v.dtype());
  switch (v.itemsize()) {
    case 1: fill_words<uint8_t>(out.data<void>(), n, v.data<void>()); break;
    case 2: fill_words<uint16_t>(out.data<void>(), n, v.data<void>()); break;
    case 4: fill_words<uint32_t>(out.data<void>(), n, v.data<void>()); break;
    case 8: fill_words<uint64_t>(out.data<void>(), n, v.data<void>()); break;
    default: throw std::invalid_argument("aligned_full: unsupported element size");
  }
  return out;
}

mx::array aligned_copy(const mx::array& a) {
  if (a.size() == 0) throw std::invalid_argument("aligned_copy: the array has no elements");
  mx::array src = mx::contiguous(a, /*allow_col_major=*/false, mx::Device::cpu);
  src.eval();
  mx::array out = aligned_empty(src.shape(), src.dtype());
  std::memcpy(out.data<char>(), src.data<char>(), src.nbytes());
  return out;
}

}  // namespace pagecheck
