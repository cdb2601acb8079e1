// Prefill K blocks transposed, and their scores with scores16_block's bits (blocks.h):
// a block's 16 K rows become D vectors of 16 keys (lane = key), so the fold's tree of a
// key's 16 partial sums becomes vertical adds instead of shuffles. chunk.h's BlockRows
// transposes a block once where 64 or more rows of a head score it; the tile path packs
// its key blocks with the same 16 x 16 register transpose.
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

// scores16_block's bits from a transposed block (transpose_block): lane k of a vector
// is key k, so each of the 16 partial sums of every key (lane l of scores16's
// accumulator: d = l, l + 16, ..., one FMA each from zero) is a vector of its own, and
// the fold's tree, (l, l + 8), then + 4, + 2, + 1, becomes vertical adds in the same
// pairs: no shuffle at all (the fold took about 30 a row per 16 keys against 128
// multiply-adds). The leaves go 0, 4, 2, 6, 1, 5, 3, 7 (bit-reversed), each summed with
// its partner l + 8 as soon as both are done, so a row holds at most three partial sums
// (hw, qw, pw) beside its two running ones: 22 vectors for 4 rows. Each K vector serves
// every row; each query element is broadcast from memory by its FMA.
template <int NR>
__attribute__((noinline)) void scores16_transposed(const float* const* q, const float* kt, int D,
                                                   float* const* s) {
  __m512 hw[NR], qw[NR], pw[NR];
  const int steps = D / kLanes;
#pragma GCC unroll 1
  for (int leaf = 0; leaf < 8; ++leaf) {
    const int l = ((leaf & 1) << 2) | (leaf & 2) | (leaf >> 2);  // 3-bit reversal
    __m512 a[NR], b[NR];  // lanes l and l + 8 of every key
    for (int r = 0; r < NR; ++r) a[r] = b[r] = _mm512_setzero_ps();
    for (int t = 0; t < steps; ++t) {
      const int d = l + kLanes * t;
      __m512 ka = _mm512_load_ps(kt + static_cast<int64_t>(d) * kBlock);
      __m512 kb = _mm512_load_ps(kt + static_cast<int64_t>(d + 8) * kBlock);
      in_register(ka);
      in_register(kb);
      for (int r = 0; r < NR; ++r) {
        a[r] = fma16(_mm512_set1_ps(q[r][d]), ka, a[r]);
        b[r] = fma16(_mm512_set1_ps(q[r][d + 8]), kb, b[r]);
      }
    }
    for (int r = 0; r < NR; ++r) {
      const __m512 h = _mm512_add_ps(a[r], b[r]);  // halves: lane l + lane l + 8
      switch (leaf) {
        case 0: case 2: case 4: case 6: hw[r] = h; break;           // waits for l + 4
        case 1: case 5: qw[r] = _mm512_add_ps(hw[r], h); break;     // quarters 0, 1
        case 3: pw[r] = _mm512_add_ps(qw[r], _mm512_add_ps(hw[r], h)); break;  // pair 0
        default:  // pair 1, then singles: pair 0 + pair 1
          _mm512_storeu_ps(s[r], _mm512_add_ps(pw[r], _mm512_add_ps(qw[r], _mm512_add_ps(hw[r], h))));
      }
    }
  }
}

// scores16_transposed for nr <= kRowBlock rows.
inline void scores16_transposed_rows(const float* const* q, int nr, const float* kt, int D, float* const* s) {
  switch (nr) {
    case 1: scores16_transposed<1>(q, kt, D, s); return;
    case 2: scores16_transposed<2>(q, kt, D, s); return;
    case 3: scores16_transposed<3>(q, kt, D, s); return;
    default: scores16_transposed<4>(q, kt, D, s); return;
  }
}

}  // namespace pagecheck
#endif
