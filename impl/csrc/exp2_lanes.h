// A softmax's weights on 16 lanes (blocks.h): exp2_nonpositive (numerics.h) vectorized with
// the scalar function's bits, and exp2_shifted, which makes a row's weights and their sum.
#pragma once

#include "lanes.h"

namespace pagecheck {

#if defined(__AVX512F__)
// exp2_nonpositive's (numerics.h) value on 16 lanes for xc in [-127, 0]: p(f) 2^n, with
// the scalar function's operations in its order.
inline __m512 exp2_in_range16(__m512 xc) {
  const __m512 shift = _mm512_set1_ps(12582912.f);
  const __m512 r = _mm512_sub_ps(_mm512_add_ps(xc, shift), shift);
  const __m512 f = _mm512_sub_ps(xc, r);
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  p = fma16(p, f, _mm512_set1_ps(1.339887440266574e-3f));
  p = fma16(p, f, _mm512_set1_ps(9.618437357674640e-3f));
  p = fma16(p, f, _mm512_set1_ps(5.550332471162809e-2f));
  p = fma16(p, f, _mm512_set1_ps(2.402264791363012e-1f));
  p = fma16(p, f, _mm512_set1_ps(6.931472028550421e-1f));
  p = fma16(p, f, _mm512_set1_ps(1.0f));
  const __m512i n = _mm512_cvttps_epi32(r);
  const __m512 two_n = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n, _mm512_set1_epi32(127)), 23));
  return _mm512_mul_ps(p, two_n);
}

// exp2_nonpositive (numerics.h) on 16 lanes: the same operations in the same order,
// lane by lane, so every lane's bits equal the scalar function's. Where every lane is at
// least -126 (a softmax's weights, nearly always) the clamp and the tails' blends change
// nothing, and are skipped: six vector ops of about twenty.
inline __m512 exp2_nonpositive16(__m512 x) {
  const __m512 edge = _mm512_set1_ps(-126.f);
  const __mmask16 in_range = _mm512_cmp_ps_mask(x, edge, _CMP_GE_OQ);
  if (in_range == 0xFFFF) return exp2_in_range16(x);
  const __m512 lim = _mm512_set1_ps(-127.f);
  const __m512 xc = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, lim, _CMP_GE_OQ), lim, x);
  const __m512 y = exp2_in_range16(xc);
  const __mmask16 below = _mm512_cmp_ps_mask(x, edge, _CMP_LT_OQ);
  const __m512 tail = _mm512_mask_blend_ps(below, x, _mm512_setzero_ps());  // NaN stays NaN
  return _mm512_mask_blend_ps(in_range, tail, y);
}
#endif

// p[i] = exp2_nonpositive((p[i] - m) * scale) for i < n; returns lane_sum(p, first, n)
// of the results (numerics.h), added up as they are made instead of in a second pass
// over them (that pass was 1.8% of a f32 prefill L 2048). Here lane k adds the row's
// keys i == k (mod 16), lane_sum's lanes follow their positions first + i: the same 16
// partial sums, rotated by first, and every level of fold_lanes adds lanes w apart,
// pairs a rotation keeps, so the fold gives the same bits. A lane past n adds +0, which
// changes no sum of weights (>= 0 or NaN).
inline float exp2_shifted(float* p, int n, float m, float scale, int first) {
  int i = 0;
#if defined(__AVX512F__)
  const __m512 mv = _mm512_set1_ps(m), sv = _mm512_set1_ps(scale);
  __m512 sum = _mm512_setzero_ps();
  for (; i + kLanes <= n; i += kLanes) {  // whole vectors unmasked (0.6% of that prefill)
    const __m512 y = exp2_nonpositive16(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(p + i), mv), sv));
    _mm512_storeu_ps(p + i, y);
    sum = _mm512_add_ps(sum, y);
  }
  if (i < n) {
    const __mmask16 live = __mmask16((1u << (n - i)) - 1);
    const __m512 x = _mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, p + i), mv), sv);
    const __m512 y = exp2_nonpositive16(x);
    _mm512_mask_storeu_ps(p + i, live, y);
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(live, y));
  }
  (void)first;
  return fold_lanes16(sum);
#else
  for (; i < n; ++i) p[i] = exp2_nonpositive((p[i] - m) * scale);
  return lane_sum(p, first, n);
#endif
}

}  // namespace pagecheck
