// The score pipeline past the dot product (contract v2, REFERENCE.md 1b): a raw score
// q.k becomes the logit  c * tanh(scale * q.k / c) + slope * (j - p).
//
// One template, `logit`, written once over a lane type: `float` (the scalar tail) or
// `__m512` (16 keys at once). Both instantiations perform the same IEEE operations in
// the same order (the helpers below map one to one; exp2 is numerics.h's polynomial in
// either form), so a key's logit has the same bits whichever loop computed it, and the
// decode and prefill schedules, which split keys differently, agree bit for bit.
//
// tanh never goes through e^x of a positive argument: e^x overflows past x ~ 88 and
// (e^x - e^-x) / (e^x + e^-x) turns into inf / inf = NaN (vLLM #56578). Here
//   |x| >  0.625: tanh|x| = (1 - e) / (1 + e), e = e^(-2|x|) in (0, 0.29): never
//                 overflows, and saturates to exactly 1 once e underflows (|x| >~ 44);
//   |x| <= 0.625: Cephes' tanhf odd polynomial x + x^3 P(x^2) (no cancellation);
// sign restored last; a NaN stays NaN. Relative error at most 1.7e-7 (3 ulps), measured
// in a float32 emulation over |x| from 1e-8 to 50 against float64 tanh.
#pragma once

#include <cstdint>

#include "blocks.h"
#include "numerics.h"

namespace pagecheck {

constexpr float kMinusTwoLog2e = -2.8853900817779268f;  // e^(-2z) = 2^(z * this)
constexpr float kTanhSplit = 0.625f;

inline float splat(float x, float) { return x; }
inline float lane_mul(float a, float b) { return a * b; }
inline float lane_add(float a, float b) { return a + b; }
inline float lane_sub(float a, float b) { return a - b; }
inline float lane_div(float a, float b) { return a / b; }
inline float lane_fma(float a, float b, float c) { return fmadd(a, b, c); }
inline float lane_abs(float a) { return bits_to_float(float_to_bits(a) & 0x7FFFFFFFu); }  // as vandps
inline float lane_exp2(float a) { return exp2_nonpositive(a); }
inline float lane_pick(bool take_b, float a, float b) { return take_b ? b : a; }
inline bool lane_gt(float a, float b) { return a > b; }
inline bool lane_lt(float a, float b) { return a < b; }
inline float lane_neg_where(bool neg, float a) { return neg ? 0.f - a : a; }

#if defined(__AVX512F__)
inline __m512 splat(float x, __m512) { return _mm512_set1_ps(x); }
inline __m512 lane_mul(__m512 a, __m512 b) { return _mm512_mul_ps(a, b); }
inline __m512 lane_add(__m512 a, __m512 b) { return _mm512_add_ps(a, b); }
inline __m512 lane_sub(__m512 a, __m512 b) { return _mm512_sub_ps(a, b); }
inline __m512 lane_div(__m512 a, __m512 b) { return _mm512_div_ps(a, b); }
inline __m512 lane_fma(__m512 a, __m512 b, __m512 c) { return fma16(a, b, c); }
inline __m512 lane_abs(__m512 a) { return _mm512_abs_ps(a); }
inline __m512 lane_exp2(__m512 a) { return exp2_nonpositive16(a); }
inline __m512 lane_pick(__mmask16 take_b, __m512 a, __m512 b) { return _mm512_mask_blend_ps(take_b, a, b); }
inline __mmask16 lane_gt(__m512 a, __m512 b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
inline __mmask16 lane_lt(__m512 a, __m512 b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
inline __m512 lane_neg_where(__mmask16 neg, __m512 a) { return _mm512_mask_sub_ps(a, neg, _mm512_setzero_ps(), a); }
#endif

// tanh(x) lane by lane (see the top of this file).
template <class V>
inline V lane_tanh(V x) {
  const V z = lane_abs(x), one = splat(1.f, x);
  const V e = lane_exp2(lane_mul(z, splat(kMinusTwoLog2e, x)));
  const V far = lane_div(lane_sub(one, e), lane_add(one, e));
  const V z2 = lane_mul(z, z);
  V p = splat(-5.70498872745e-3f, x);
  p = lane_fma(p, z2, splat(2.06390887954e-2f, x));
  p = lane_fma(p, z2, splat(-5.37397155531e-2f, x));
  p = lane_fma(p, z2, splat(1.33314422036e-1f, x));
  p = lane_fma(p, z2, splat(-3.33332819422e-1f, x));
  const V near = lane_fma(lane_mul(p, z2), z, z);
  return lane_neg_where(lane_lt(x, splat(0.f, x)), lane_pick(lane_gt(z, splat(kTanhSplit, x)), near, far));
}

// The logit of raw scores `raw` at key distances `dist` = j - p (as floats): scale, then
// the soft-cap (softcap > 0), then the ALiBi bias (alibi).
template <class V>
inline V logit(V raw, V dist, float scale, float softcap, bool alibi, float slope) {
  V t = lane_mul(raw, splat(scale, raw));
  if (softcap > 0.f) t = lane_mul(splat(softcap, raw), lane_tanh(lane_div(t, splat(softcap, raw))));
  if (alibi) t = lane_add(t, lane_mul(splat(slope, raw), dist));
  return t;
}

// s[k] = logit of s[k] for the keys j0 + k, k < n, of a row at position p.
inline void logits_of(float* s, int n, int j0, int p, float scale, float softcap, const float* slope) {
  const bool alibi = slope != nullptr;
  const float sl = alibi ? *slope : 0.f;
  int k = 0;
#if defined(__AVX512F__)
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (; k + kLanes <= n; k += kLanes) {
    const __m512 dist = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_set1_epi32(j0 + k - p), lanes));
    _mm512_storeu_ps(s + k, logit(_mm512_loadu_ps(s + k), dist, scale, softcap, alibi, sl));
  }
#endif
  for (; k < n; ++k) s[k] = logit(s[k], static_cast<float>(j0 + k - p), scale, softcap, alibi, sl);
}

}  // namespace pagecheck
