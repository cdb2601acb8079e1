// The score loops (blocks.h): 16 keys x one query row (scores16) or up to kRowBlock rows
// (scores16_rows -> scores16_block), dot products folded by scores16's tree (KeyFold).
#pragma once

#include "lanes.h"

namespace pagecheck {

// s[k] = dot16(q, rows[k]) for k < 16. Every row pointer must be readable (pad a short
// block with a row of zeros). D: the head dim; the vector path needs D % 16 == 0.
template <class E>
inline void scores16(const float* q, const typename E::T* const* rows, int D, float* s) {
#if defined(__AVX512F__)
  if (D % kLanes == 0) {
    __m512 acc[kBlock];
    for (int k = 0; k < kBlock; ++k) acc[k] = _mm512_setzero_ps();
    for (int d = 0; d < D; d += kLanes) {
      const __m512 qv = _mm512_loadu_ps(q + d);
      for (int k = 0; k < kBlock; ++k) acc[k] = fma16(qv, load16<E>(rows[k] + d), acc[k]);
    }
    // Fold pairs of keys (k, k+1) so that the result lands in natural key order:
    // halves hold keys (2j, 2j+1), then quarters (4m .. 4m+3), pairs, singles.
    __m512 h[8], qu[4], pr[2];
    for (int j = 0; j < 8; ++j) h[j] = fold_halves(acc[2 * j], acc[2 * j + 1]);
    for (int m = 0; m < 4; ++m) qu[m] = fold_quarters(h[2 * m], h[2 * m + 1]);
    for (int n = 0; n < 2; ++n) pr[n] = fold_pairs(qu[2 * n], qu[2 * n + 1]);
    _mm512_storeu_ps(s, fold_singles(pr[0], pr[1]));
    return;
  }
#endif
  for (int k = 0; k < kBlock; ++k) s[k] = dot16<E>(q, rows[k], D);
}

constexpr int kRowBlock = 4;  // query rows per register block

#if defined(__AVX512F__)
// The fold of NR rows' 16 scores, four keys at a time (scores16's tree): add(m, a) takes
// each row's four accumulators of keys 4m .. 4m + 3, m ascending, and folds them at once
// (halves, then quarters; every two groups into pairs), store(s) adds the two pairs
// (singles) and writes each row's scores in key order. Shared by the FMA loop below and
// the pair dot product's (pair_dots.h), which fill the accumulators differently.
// Always inlined: where GCC kept add() out of line (decode.cpp's build, where both loops
// call it) the caller passed its 16 accumulators through the stack every four keys, and
// a f32 decode B 1 S 1024 pages of 16 took 0.145 instead of 0.119 ms (AMD, 2 threads).
template <int NR>
struct KeyFold {
  __m512 quarter[NR], pair[NR][2];

  __attribute__((always_inline)) static void clear(__m512 (&a)[NR][4]) {
    for (int r = 0; r < NR; ++r)
      for (int i = 0; i < 4; ++i) a[r][i] = _mm512_setzero_ps();
  }
  __attribute__((always_inline)) void add(int m, const __m512 (&a)[NR][4]) {
    for (int r = 0; r < NR; ++r) {
      const __m512 keys = fold_quarters(fold_halves(a[r][0], a[r][1]), fold_halves(a[r][2], a[r][3]));
      if (m % 2 == 0) quarter[r] = keys;
      else pair[r][m / 2] = fold_pairs(quarter[r], keys);
    }
  }
  __attribute__((always_inline)) void store(float* const* s) const {
    for (int r = 0; r < NR; ++r) _mm512_storeu_ps(s[r], fold_singles(pair[r][0], pair[r][1]));
  }
};

// NR rows x 16 keys, four keys at a time: 4 NR accumulators, 4 + NR loads per step.
// Each group of four keys is folded as soon as its dot products are done (halves, then
// quarters, as in scores16), and every two groups into pairs, so only two partial folds
// per row wait in registers; holding all 16 accumulators of every row until the end
// sent them through the stack (4 KiB a call for 4 rows; prefill 5% slower). Not inlined:
// inside attend_chunk the register allocator spilled the loads in_register keeps (29
// vectors live at the last group) to the stack. Both together, on the AMD machine
// (bench/fma_loops.cpp, one core, ceiling 3.7): the loop alone on 16-key blocks from L1
// to 4 MiB at 2.3-2.7 G FMA/s against 1.2-1.4, decode B 1 S 256 f32 one thread 10-17%
// faster, prefill L = S = 512 f32 10-20%.
template <class E, int NR>
__attribute__((noinline)) void scores16_block(const float* const* q, const typename E::T* const* rows, int D,
                                              float* const* s, const typename E::T* const* next) {
  KeyFold<NR> fold;
#pragma GCC unroll 4
  for (int k0 = 0; k0 < kBlock; k0 += 4) {
    __m512 a[NR][4];
    KeyFold<NR>::clear(a);
    for (int d = 0; d < D; d += kLanes) {
      __m512 kv[4];
      for (int i = 0; i < 4; ++i) {
        kv[i] = load16<E>(rows[k0 + i] + d);
        in_register(kv[i]);
        ask_next<E>(next, k0 + i, d);
      }
      for (int r = 0; r < NR; ++r) {
        __m512 qv = _mm512_loadu_ps(q[r] + d);
        in_register(qv);
        for (int i = 0; i < 4; ++i) a[r][i] = fma16(qv, kv[i], a[r][i]);
      }
    }
    fold.add(k0 / 4, a);
  }
  fold.store(s);
}
#endif

// scores16 for nr <= kRowBlock rows: s[r][k] = dot16(q[r], rows[k]). next: the rows of
// the block the caller reads after this one, or null (ask_next).
template <class E>
inline void scores16_rows(const float* const* q, int nr, const typename E::T* const* rows, int D, float* const* s,
                          const typename E::T* const* next = nullptr) {
#if defined(__AVX512F__)
  if (D % kLanes == 0) {
    switch (nr) {
      case 1: scores16_block<E, 1>(q, rows, D, s, next); return;
      case 2: scores16_block<E, 2>(q, rows, D, s, next); return;
      case 3: scores16_block<E, 3>(q, rows, D, s, next); return;
      default: scores16_block<E, 4>(q, rows, D, s, next); return;
    }
  }
#endif
  (void)next;
  for (int r = 0; r < nr; ++r) scores16<E>(q[r], rows, D, s[r]);
}

}  // namespace pagecheck
