// The value loops (blocks.h): o[d] += p_j * v_j[d] for j ascending, one row (weigh) or up
// to kWeighRows rows over the same keys (weigh_rows -> weigh_keys), the outputs held in
// registers across the block.
#pragma once

#include <algorithm>

#include "lanes.h"

namespace pagecheck {

// Query rows a value pass weighs at once (weigh_rows): 6 x 4 accumulators, 4 V rows' vectors
// and a broadcast hold 29 of the 32 registers.
constexpr int kWeighRows = 6;

#if defined(__AVX512F__)
// NR rows x NV output vectors (columns d0 .. d0 + 16 NV) in registers across the keys,
// asking for the V rows of `next` as it goes (Asks) or not (a prefill's value pass: its
// rows sit in scratch). Two functions, not one loop with a test of `next`: with the test
// and a base address per vector inside one loop GCC ran out of general registers (the
// key count reloaded from the stack and a row pointer parked in a vector register every
// key, integer ops in the FMA ports' slots), and two loops of one function were merged
// back into one under Zen's tuning. Out of line, so bench/test_fma_loops.py can read
// them. The loops over the accumulators are unrolled by order: left to GCC they were not,
// so the 16 accumulators went through the stack on the way in and out (16 stores and 16
// loads a call of 256 multiply-adds). f32, bench/fma_loops, one thread, AMD: without
// asks 2.0-2.5 -> 2.6-3.1 GFMA/s, with asks 2.2-2.3 -> 2.4-2.8.
template <class E, int NR, int NV, bool Asks>
__attribute__((noinline)) void weigh_keys(const typename E::T* const* rows, const float* const* p, int n,
                                          float* const* o, int d0, const typename E::T* const* next, bool fresh) {
  __m512 acc[NR][NV];
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = fresh ? _mm512_setzero_ps() : _mm512_loadu_ps(o[r] + d0 + v * kLanes);
  for (int j = 0; j < n; ++j) {
    const typename E::T* vr = rows[j] + d0;
    __m512 vj[NV];
    for (int v = 0; v < NV; ++v) {
      vj[v] = load16<E>(vr + v * kLanes);
      if constexpr (Asks) ask_next<E>(next, j, d0 + v * kLanes);
    }
    for (int r = 0; r < NR; ++r) {
      const __m512 pj = _mm512_set1_ps(p[r][j]);
      for (int v = 0; v < NV; ++v) acc[r][v] = fma16(pj, vj[v], acc[r][v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(o[r] + d0 + v * kLanes, acc[r][v]);
}
template <class E, int NR, int NV>
inline void weigh_block(const typename E::T* const* rows, const float* const* p, int n, float* const* o, int d0,
                        const typename E::T* const* next, bool fresh) {
  if (next != nullptr) weigh_keys<E, NR, NV, true>(rows, p, n, o, d0, next, fresh);
  else weigh_keys<E, NR, NV, false>(rows, p, n, o, d0, next, fresh);
}

template <class E, int NR>
inline void weigh_rows_nr(const typename E::T* const* rows, const float* const* p, int n, float* const* o, int D,
                          const typename E::T* const* next, bool fresh) {
  for (int d0 = 0; d0 < D; d0 += 4 * kLanes) {
    switch ((D - d0) / kLanes) {
      case 1: weigh_block<E, NR, 1>(rows, p, n, o, d0, next, fresh); break;
      case 2: weigh_block<E, NR, 2>(rows, p, n, o, d0, next, fresh); break;
      case 3: weigh_block<E, NR, 3>(rows, p, n, o, d0, next, fresh); break;
      default: weigh_block<E, NR, 4>(rows, p, n, o, d0, next, fresh); break;
    }
  }
}

// NV registers of o (columns d0 .. d0 + 16 NV) stay in registers across the block.
template <class E, int NV>
inline void weigh_columns(const typename E::T* const* rows, const float* p, int n, float* o, int d0) {
  __m512 acc[NV];
  for (int v = 0; v < NV; ++v) acc[v] = _mm512_loadu_ps(o + d0 + v * kLanes);
  for (int j = 0; j < n; ++j) {
    const __m512 pj = _mm512_set1_ps(p[j]);
    for (int v = 0; v < NV; ++v) acc[v] = fma16(pj, load16<E>(rows[j] + d0 + v * kLanes), acc[v]);
  }
  for (int v = 0; v < NV; ++v) _mm512_storeu_ps(o + d0 + v * kLanes, acc[v]);
}
#endif

// o[d] += p[j] * rows[j][d] for j = 0 .. n-1 in order, one fused multiply-add each.
template <class E>
inline void weigh(const typename E::T* const* rows, const float* p, int n, float* o, int D) {
#if defined(__AVX512F__)
  if (D % kLanes == 0) {
    for (int d0 = 0; d0 < D; d0 += 8 * kLanes) {
      switch ((D - d0) / kLanes) {
        case 1: weigh_columns<E, 1>(rows, p, n, o, d0); break;
        case 2: weigh_columns<E, 2>(rows, p, n, o, d0); break;
        case 3: weigh_columns<E, 3>(rows, p, n, o, d0); break;
        case 4: weigh_columns<E, 4>(rows, p, n, o, d0); break;
        case 5: weigh_columns<E, 5>(rows, p, n, o, d0); break;
        case 6: weigh_columns<E, 6>(rows, p, n, o, d0); break;
        case 7: weigh_columns<E, 7>(rows, p, n, o, d0); break;
        default: weigh_columns<E, 8>(rows, p, n, o, d0); break;
      }
    }
    return;
  }
#endif
  for (int j = 0; j < n; ++j) axpy<E>(p[j], rows[j], o, D);
}

// weigh for nr <= kWeighRows rows over the same n keys: o[r][d] += p[r][j] * rows[j][d].
// fresh: the rows' outputs start from zero (what o held is ignored, never read), as if
// o had been zeroed first: the same operations, without the zeroing pass and the loads.
template <class E>
inline void weigh_rows(const typename E::T* const* rows, const float* const* p, int nr, int n, float* const* o, int D,
                       const typename E::T* const* next = nullptr, bool fresh = false) {
#if defined(__AVX512F__)
  if (D % kLanes == 0) {
    switch (nr) {
      case 1: weigh_rows_nr<E, 1>(rows, p, n, o, D, next, fresh); return;
      case 2: weigh_rows_nr<E, 2>(rows, p, n, o, D, next, fresh); return;
      case 3: weigh_rows_nr<E, 3>(rows, p, n, o, D, next, fresh); return;
      case 4: weigh_rows_nr<E, 4>(rows, p, n, o, D, next, fresh); return;
      case 5: weigh_rows_nr<E, 5>(rows, p, n, o, D, next, fresh); return;
      default: weigh_rows_nr<E, 6>(rows, p, n, o, D, next, fresh); return;
    }
  }
#endif
  (void)next;
  for (int r = 0; r < nr; ++r) {
    if (fresh) std::fill(o[r], o[r] + D, 0.f);
    weigh<E>(rows, p[r], n, o[r], D);
  }
}

}  // namespace pagecheck
