// Encoding of the write path: float values -> the 8-bit codes of a quantized pool
// (contract/kv_format.py). numerics.h decodes; this header is the only place that encodes.
//
//   code = encode(x / s)          x widened exactly to float32, x / s one IEEE float32
//                                 division (correctly rounded), then encoded exactly:
//   encode(y)  finite y           the code nearest y, ties to the even code (the one whose
//                                 last mantissa bit, or int8 integer, is even), clamped
//                                 to +-max finite (saturation: e4m3 448, e5m2 57344,
//                                 int8 127; int8 never -128)
//              +-inf              +-max finite (saturates, as CUDA's __NV_SATFINITE)
//              NaN                fp8: the NaN code 0x7f with y's sign bit (0xff when
//                                 negative); int8 (no NaN): 0, as cvt.rni.sat.s8.f32
//              -0 and negatives   fp8 keep the sign: a negative y that rounds to zero is
//              rounding to 0      0x80 (-0); int8 has one zero
//
// The rounding is integer arithmetic on y's bits (no float operation that could round
// twice): |y| = sig * 2^(e - 23), and the code grid near |y| is spaced 2^q, so the code's
// integer part is sig / 2^(q - e + 23) rounded to nearest even with a shift, a remainder
// and a comparison against the half. fp8 subnormals fall out of the same shift: below the
// smallest normal exponent the spacing stays 2^(emin - M) (e4m3 2^-9, e5m2 2^-16).
//
// Token scales (one per (token, KV head) row): s = max|x| / max_finite in float32, so the
// row's largest element maps to the format's largest finite value. Rules for the rows
// that have no such scale:
//   a row of zeros, or one whose quotient underflows to 0   s = 1.0 (its codes are all 0)
//   a row holding NaN or +-inf                              s = NaN: its codes are the NaN
//       code (int8: 0) and decode(code) * NaN is NaN, so an attention that reads the row
//       shows the poison instead of a silently clipped value.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "numerics.h"

namespace pagecheck {

// The bit layout of an fp8 format: mantissa bits M, smallest normal exponent emin (the
// subnormal step is 2^(emin - M)), and its largest finite code.
struct Fp8Layout {
  int mantissa_bits;
  int min_exponent;
  uint8_t max_code;
};

constexpr Fp8Layout kE4M3Layout{3, -6, 0x7E};   // 0x7e = 448; 0x7f is NaN
constexpr Fp8Layout kE5M2Layout{2, -14, 0x7B};  // 0x7b = 57344; 0x7c is inf

// A float32 magnitude (bits, finite) as sig * 2^(exp - 23), sig an integer < 2^24.
struct Magnitude {
  uint64_t sig;
  int exp;
};

inline Magnitude magnitude_of(uint32_t mag) {
  const int field = static_cast<int>(mag >> 23);
  if (field == 0) return {mag, -126};  // float32 subnormal: no implicit bit
  return {(mag & 0x7FFFFFu) | 0x800000u, field - 127};
}

// |y| / 2^q rounded to the nearest integer, ties to even, exactly. A result that does
// not fit 2^23 (|y| / 2^q >= 2^23, beyond every format here) comes back as 2^24.
inline uint64_t round_to_multiple(Magnitude m, int q) {
  const int shift = q - (m.exp - 23);  // |y| / 2^q = sig / 2^shift
  if (shift <= 0) return uint64_t{1} << 24;
  if (shift > 32) return 0;  // sig < 2^24 < half: rounds to 0
  const uint64_t n = m.sig >> shift;
  const uint64_t rem = m.sig & ((uint64_t{1} << shift) - 1);
  const uint64_t half = uint64_t{1} << (shift - 1);
  return n + (rem > half || (rem == half && (n & 1u)));
}

inline uint8_t encode_fp8(float y, Fp8Layout f) {
  const uint32_t u = float_to_bits(y);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t mag = u & 0x7FFFFFFFu;
  if (mag > 0x7F800000u) return sign | 0x7F;       // NaN
  if (mag == 0x7F800000u) return sign | f.max_code;  // +-inf saturates
  const Magnitude m = magnitude_of(mag);
  // In the binade [2^e, 2^(e+1)) the codes are the multiples of 2^(e - M); below emin
  // the spacing stays 2^(emin - M) (subnormals). With e' = max(e, emin) and n the
  // rounded multiple, code = ((e' - emin) << M) + n: n == 2^(M+1) (a carry into the
  // next binade) and n == 2^M below emin (the smallest normal) land on the right code.
  const int e = m.exp > f.min_exponent ? m.exp : f.min_exponent;
  const uint64_t n = round_to_multiple(m, e - f.mantissa_bits);
  const uint64_t code = (static_cast<uint64_t>(e - f.min_exponent) << f.mantissa_bits) + n;
  return sign | static_cast<uint8_t>(code > f.max_code ? f.max_code : code);
}

inline int8_t encode_int8(float y) {
  const uint32_t u = float_to_bits(y);
  const uint32_t mag = u & 0x7FFFFFFFu;
  if (mag > 0x7F800000u) return 0;  // NaN: int8 has no NaN code
  const uint64_t n = mag == 0x7F800000u ? 127 : round_to_multiple(magnitude_of(mag), 0);
  const int v = static_cast<int>(n > 127 ? 127 : n);  // symmetric: -128 is never written
  return static_cast<int8_t>(u >> 31 ? -v : v);
}

// The encoders as element types (one per kv_code), beside numerics.h's decoders.
struct EncodeE4M3 {
  using T = uint8_t;
  static uint8_t encode(float y) { return encode_fp8(y, kE4M3Layout); }
  static constexpr float kMax = 448.f;
};
struct EncodeE5M2 {
  using T = uint8_t;
  static uint8_t encode(float y) { return encode_fp8(y, kE5M2Layout); }
  static constexpr float kMax = 57344.f;
};
struct EncodeI8 {
  using T = int8_t;
  static int8_t encode(float y) { return encode_int8(y); }
  static constexpr float kMax = 127.f;
};

// The token scale of one row of D elements of type E (F32 / F16 / BF16), rules above.
template <class E>
inline float row_scale(const typename E::T* x, int64_t D, float max_finite) {
  float amax = 0.f;
  for (int64_t d = 0; d < D; ++d) {
    const float a = std::fabs(E::load(x[d]));
    if (!(a <= std::numeric_limits<float>::max())) return std::numeric_limits<float>::quiet_NaN();
    amax = a > amax ? a : amax;
  }
  const float s = amax / max_finite;
  return s > 0.f ? s : 1.f;
}

}  // namespace pagecheck
