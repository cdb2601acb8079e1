// Prefill K blocks transposed, and their scores with scores16_block's bits (score_loops.h):
// a block's 16 K rows become D vectors of 16 keys (lane = key), so the fold's tree of a
// key's 16 partial sums becomes vertical adds instead of shuffles. transposed_walk.h's
// score_transposed transposes blocks once where 64 or more rows of a head score them, in
// pairs; the tile path packs its key blocks with the same 16 x 16 register transpose.
#pragma once

#include <cstdint>

#include "blocks.h"

#if defined(__AVX512F__)
namespace pagecheck {

// In-place transpose of 16 x 16 32-bit elements: r[i] lane k becomes r[k] lane i (the
// tile path packs key blocks with it, transpose_block scores prefill blocks from it).
inline void transpose16(__m512i (&r)[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {  // pairs of rows: (a0 b0 a1 b1 | a2 b2 a3 b3) per 128-bit lane
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // r[4i + e], lane L: rows 4i .. 4i + 3 of column 4L + e
    r[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i + 0], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i + 0], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  __m512i out[16];
  for (int e = 0; e < 4; ++e) {  // column 4L + e gathers lane L of r[e], r[4 + e], r[8 + e], r[12 + e]
    const __m512i ab_lo = _mm512_shuffle_i32x4(r[e], r[4 + e], 0x44), ab_hi = _mm512_shuffle_i32x4(r[e], r[4 + e], 0xEE);
    const __m512i cd_lo = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0x44),
                  cd_hi = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0xEE);
    out[e] = _mm512_shuffle_i32x4(ab_lo, cd_lo, 0x88);
    out[4 + e] = _mm512_shuffle_i32x4(ab_lo, cd_lo, 0xDD);
    out[8 + e] = _mm512_shuffle_i32x4(ab_hi, cd_hi, 0x88);
    out[12 + e] = _mm512_shuffle_i32x4(ab_hi, cd_hi, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = out[i];
}

// A block's 16 K rows transposed into kt (D x 16 floats, 64-byte aligned; D % 16 == 0):
// kt[d * 16 + k] = rows[k][d], widened to float32 (exact) as they are loaded.
template <class E>
inline void transpose_block(const typename E::T* const* rows, int D, float* kt) {
  for (int d0 = 0; d0 < D; d0 += kLanes) {
    __m512i r[kBlock];
    for (int k = 0; k < kBlock; ++k) r[k] = _mm512_castps_si512(load16<E>(rows[k] + d0));
    transpose16(r);
    for (int i = 0; i < kLanes; ++i)
      _mm512_store_ps(kt + static_cast<int64_t>(d0 + i) * kBlock, _mm512_castsi512_ps(r[i]));
  }
}

// scores16_block's bits from NB transposed blocks (transpose_block; kt[b]: keys 16 b ..
// 16 b + 15, s[r] gets 16 NB scores): lane k of a vector is a key, so each of the 16
// partial sums of every key (lane l of scores16's accumulator: d = l, l + 16, ..., one
// FMA each from zero) is a vector of its own, and the fold's tree, (l, l + 8), then + 4,
// + 2, + 1, becomes vertical adds in the same pairs: no shuffle at all (the fold took
// about 30 a row per 16 keys against 128 multiply-adds). The leaves go 0, 4, 2, 6, 1, 5,
// 3, 7 (bit-reversed), each summed with its partner l + 8 as soon as both are done, so a
// row holds at most three partial sums per block: hw in registers beside the running
// ones, qw and pw (each read once or twice in 8 leaves) in memory, which GCC keeps in
// registers for one block (NR 4: 12 beside 8 accumulators and 2 K vectors) and not for
// two (24 more would not fit in 32 beside 16 accumulators and 4 K vectors).
// Two blocks at once (the prefill's pairs where transposed_pairs_enabled(), transposed_walk.h's
// score_transposed): each broadcast query element serves both, so a step loads 4 K
// vectors and 2 NR query elements for 4 NR multiply-adds, against 2 + 2 NR for 2 NR with
// one block. On the Intel machine (two 512-bit loads and two FMAs a cycle) one block at a
// time is bound by its loads (10 per 8 FMAs): bench/fma_loops, one thread, transposed
// blocks from L1, 3.2-3.4 GFMA/s one at a time, 4.2-4.4 two at a time (5.8 the peak);
// prefill L = S = 2048 f32 pages of 128, 2 threads, perf: the score loop's share of the
// call 45% -> 40% beside the value loop's 32% -> 38% (as many multiply-adds). So is AMD's
// Zen 5 (the same two of each): one block 5.5, two 6.9. On AMD's Zen 4 (one 512-bit FMA a
// cycle, as two halves) the FMAs bound both, and the pairs' pending sums in memory cost
// more than the broadcasts they save: one block 3.4-3.6, two 2.9-3.3 GFMA/s (prefill
// L = S = 2048 f32, 2 threads, in turns with vLLM's op: pages of 128 5-8% faster one block
// at a time; the rule by CPU family is transposed_pairs.cpp's). Each key's sums are the
// same adds in the same pairs whatever NB, so the bits are the fold's.
template <int NR, int NB>
__attribute__((noinline)) void scores_transposed(const float* const* q, const float* const* kt, int D,
                                                 float* const* s) {
  // All zeroed only so that no path reads them unset in GCC's eyes (-Wmaybe-uninitialized;
  // leaves 0, 1 and 3 write them first): a few stores a call of 16 NR NB x D / 16 FMAs.
  __m512 hw[NR][NB];
  for (int r = 0; r < NR; ++r)
    for (int b = 0; b < NB; ++b) hw[r][b] = _mm512_setzero_ps();
  alignas(64) float qw[NR][NB][kLanes] = {}, pw[NR][NB][kLanes] = {};
  const int steps = D / kLanes;
#pragma GCC unroll 1
  for (int leaf = 0; leaf < 8; ++leaf) {
    const int l = ((leaf & 1) << 2) | (leaf & 2) | (leaf >> 2);  // 3-bit reversal
    __m512 a[NR][NB], b[NR][NB];  // lanes l and l + 8 of every key
    for (int r = 0; r < NR; ++r)
      for (int k = 0; k < NB; ++k) a[r][k] = b[r][k] = _mm512_setzero_ps();
    for (int t = 0; t < steps; ++t) {
      const int64_t d = l + kLanes * t;
      __m512 ka[NB], kb[NB];
      for (int k = 0; k < NB; ++k) {
        ka[k] = _mm512_load_ps(kt[k] + d * kBlock);
        kb[k] = _mm512_load_ps(kt[k] + (d + 8) * kBlock);
        in_register(ka[k]);
        in_register(kb[k]);
      }
      for (int r = 0; r < NR; ++r) {
        const __m512 qa = _mm512_set1_ps(q[r][d]), qb = _mm512_set1_ps(q[r][d + 8]);
        for (int k = 0; k < NB; ++k) {
          a[r][k] = fma16(qa, ka[k], a[r][k]);
          b[r][k] = fma16(qb, kb[k], b[r][k]);
        }
      }
    }
    // Unrolled by order: left to GCC, one block's rows were not, so a and b went through
    // the stack every leaf (AMD, bench/fma_loops, one thread: 2.6 -> 3.4-3.6 GFMA/s).
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      for (int k = 0; k < NB; ++k) {
        const __m512 h = _mm512_add_ps(a[r][k], b[r][k]);  // halves: lane l + lane l + 8
        float* const qm = qw[r][k];
        float* const pm = pw[r][k];
        switch (leaf) {
          case 0: case 2: case 4: case 6: hw[r][k] = h; break;                       // waits for l + 4
          case 1: case 5: _mm512_store_ps(qm, _mm512_add_ps(hw[r][k], h)); break;   // quarters 0, 1
          case 3: _mm512_store_ps(pm, _mm512_add_ps(_mm512_load_ps(qm), _mm512_add_ps(hw[r][k], h))); break;  // pair 0
          default:  // pair 1, then singles: pair 0 + pair 1
            _mm512_storeu_ps(s[r] + kBlock * k, _mm512_add_ps(_mm512_load_ps(pm),
                                                              _mm512_add_ps(_mm512_load_ps(qm), _mm512_add_ps(hw[r][k], h))));
        }
      }
    }
  }
}

// scores_transposed for nr <= kRowBlock rows, of one block (kt1 null) or two.
template <int NB>
inline void scores_transposed_rows(const float* const* q, int nr, const float* const* kt, int D, float* const* s) {
  switch (nr) {
    case 1: scores_transposed<1, NB>(q, kt, D, s); return;
    case 2: scores_transposed<2, NB>(q, kt, D, s); return;
    case 3: scores_transposed<3, NB>(q, kt, D, s); return;
    default: scores_transposed<4, NB>(q, kt, D, s); return;
  }
}
inline void scores_transposed_rows(const float* const* q, int nr, const float* kt0, const float* kt1, int D,
                                   float* const* s) {
  const float* const kt[2] = {kt0, kt1};
  if (kt1 != nullptr) scores_transposed_rows<2>(q, nr, kt, D, s);
  else scores_transposed_rows<1>(q, nr, kt, D, s);
}

}  // namespace pagecheck
#endif
