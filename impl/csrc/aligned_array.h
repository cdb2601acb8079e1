// Page storage that starts on a cache line.
//
// MLX's CPU allocator keeps each buffer's size in the 8 bytes before it, and malloc puts
// a 16-byte header before each block it maps: every large MLX array starts 24 bytes into
// a cache line, so every row of a pool does too (rows of D 128 are whole lines), and each
// 64-byte load of a float32 row spans two lines. On the AMD machine (bench/fma_loops.cpp,
// one core, 2 MiB of rows) the float32 score loop ran 2.26-2.72 G FMA/s on such rows
// against 2.82-2.89 on rows that start a line, the value loop 2.68 against 2.77-2.79; a
// float32 decode B 1 S 1024 3% faster (2 threads, in turns in one process). vLLM's caches
// are torch tensors, which start on a line.
//
// The data stays in a buffer of MLX's own allocator, one line longer, at the first line
// boundary inside it (an offset into the buffer, as a slice has): a buffer with a deleter
// of its own is never donated, so every in-place pool write would copy the pool.
#pragma once

#include <cstddef>

#include "mlx/array.h"

namespace pagecheck {

constexpr size_t kLineBytes = 64;

// A row-contiguous copy of `a` (evaluated first) whose data starts on a kLineBytes
// boundary. Throws std::invalid_argument for an array of no elements.
mlx::core::array aligned_copy(const mlx::core::array& a);

// An array of `shape` and `value`'s dtype, every element `value` (one element), whose
// data starts on a kLineBytes boundary: made in its own buffer, so a pool of pages never
// holds a second copy of itself, as aligned_copy of an mx.full would (the full array,
// then the copy). Throws std::invalid_argument for a shape of no elements or a value of
// more than one element.
mlx::core::array aligned_full(const mlx::core::Shape& shape, const mlx::core::array& value);

// Gives `out` (row-contiguous, being evaluated: a primitive's output) a new buffer with
// its data on a kLineBytes boundary, as aligned_copy's.
void set_aligned_data(mlx::core::array& out);

}  // namespace pagecheck
