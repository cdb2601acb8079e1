// The two inner loops of a chunk, on blocks of up to 16 keys, with an AVX-512 path
// and a plain path that perform the *same* floating-point operations in the same
// order (numerics.h), so the two give identical bits and either may serve any row.
//
//   scores16  16 keys x 1 query row: s_k = dot16(q, k_k). Vectorized across d with one
//             16-lane accumulator per key (8 fused multiply-adds each for D = 128), then
//             the 16 accumulators are folded together by a transpose: every step adds
//             exactly the lane pairs of fold_lanes' halving tree (i + 8, i + 4, i + 2, i + 1),
//             just for 16 keys at once, and leaves key k in lane k.
//   weigh     o[d] += p_j * v_j[d] for j ascending, o held in registers across the block.
//
// The *_rows variants do the same for up to kRowBlock query rows at once. They change
// only which loads feed the multiply-adds: each K or V vector is loaded once for all
// rows and each query or output vector once for four keys / all keys of the block,
// halving the loads per fused multiply-add (the loads, not the FMAs, bounded the
// single-row loops). Every (row, key) score and every output element still sees the
// identical sequence of operations, so the bits do not change.
//
// Given the rows of the block the caller reads next, the loops also ask for its cache
// lines, one per line they consume (ask_next), so memory and arithmetic overlap.
//
// The loops take K and V rows in any element type E: a bf16 or f16 vector is widened in
// registers as it is loaded (exact), so a few rows can read a half pool in place with
// no widening pass through memory; callers with many rows per block widen the block
// once instead (widen_rows, then E = F32). See BlockRows in chunk.h.
//
// The pieces, a file each: lanes.h (a row's vectors: load16, the folds, the asks),
// score_loops.h (scores16, scores16_rows), value_loops.h (weigh, weigh_rows), exp2_lanes.h
// (exp2_shifted); this file includes them all and adds the rows' helpers below (widen,
// widen_rows, pool_rows, read_in_place).
#pragma once

#include <cstdint>
#include <type_traits>

#include "exp2_lanes.h"
#include "lanes.h"
#include "numerics.h"
#include "score_loops.h"
#include "value_loops.h"

namespace pagecheck {

// Widen one row to float32 (exact for every element type, so the vector and the
// scalar conversions give the same values).
template <class E>
inline void widen(const typename E::T* src, float* dst, int D) {
  int d = 0;
#if defined(__AVX512F__)
  if constexpr (!std::is_same_v<E, F32>) {  // the half types and the quantized codes
    for (; d + kLanes <= D; d += kLanes) _mm512_storeu_ps(dst + d, load16<E>(src + d));
  }
#endif
  for (; d < D; ++d) dst[d] = E::load(src[d]);
}

// Float32 copies of n K or V rows (a block's 16, or a chunk's for weigh_by_group),
// widened once into `buf` (n x D floats; a float32 row is copied, for rows that start
// mid cache line: see line_aligned). The missing rows of a short block point at `zeros`
// (a readable row of zeros).
template <class E>
inline void widen_rows(const typename E::T* pool, const int64_t* off, int n, int D, float* buf,
                       const float* zeros, const float** rows) {
  for (int k = 0; k < n; ++k) {
    float* dst = buf + static_cast<int64_t>(k) * D;
    widen<E>(pool + off[k], dst, D);
    rows[k] = dst;
  }
  for (int k = n; k < kBlock; ++k) rows[k] = zeros;
}

// Whether rows of D elements from `row` on all start on a cache line: when they do
// not, every 64-byte vector load touches two lines (MLX's buffers start 24 bytes into
// one here, which made a float32 prefill read in place 18% slower than from copies).
template <class T>
inline bool line_aligned(const T* row, int D) {
  return (reinterpret_cast<uintptr_t>(row) | (static_cast<uintptr_t>(D) * sizeof(T))) % 64 == 0;
}

// Whether a loop over many rows reads these pool rows in place rather than from float32
// copies: only float32 rows that start on a cache line (a half type is widened once).
template <class E>
inline bool read_in_place(const typename E::T* row, int D) {
  if constexpr (std::is_same_v<E, F32>) return line_aligned(row, D);
  else return false;
}

// Pointers to n K or V rows of the pool (a block's 16, or a chunk's), read in place
// whatever the element type; the missing rows of a short block point at `zeros` (a
// readable row of zeros).
template <class E>
inline void pool_rows(const typename E::T* pool, const int64_t* off, int n, const typename E::T* zeros,
                      const typename E::T** rows) {
  for (int k = 0; k < n; ++k) rows[k] = pool + off[k];
  for (int k = n; k < kBlock; ++k) rows[k] = zeros;
}

}  // namespace pagecheck
