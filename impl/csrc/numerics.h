// The canonical arithmetic of the paged-attention kernels.
//
// Both schedules (decode, prefill) compute every query row with exactly the
// functions in this header, in exactly the same order, so a row's output bits
// depend only on that row's query, keys and values (REFERENCE.md invariants 6-8):
//
//   score    s_j = dot16(q, k_j) * (scale * log2 e)     dot16: 16 lanes over d, fixed tree
//   chunk    keys are cut at absolute positions that are multiples of kChunk;
//            per chunk: m = max s_j, p_j = exp2(s_j - m), l = lane_sum p_j (16 lanes by
//            absolute position, fixed fold),
//            o = sum p_j v_j (ascending j, one fused multiply-add per term)
//   merge    chunk states are folded in ascending chunk order, starting from the first
//   sink     (if any) folded into the merged state once: add_sink
//   finish   out = o * (1 / l), cast once to the output dtype; lse = m + ln l
//
// The build uses -ffp-contract=off and no -ffast-math, so the compiler may vectorize
// these loops but never reorder or fuse their floating-point operations. A bfloat16
// call on AMX tiles follows its own arithmetic (amx.h) and shares chunk, merge and
// finish with this one.
#pragma once

#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace pagecheck {

// Keys per chunk. A chunk is the unit of decode parallelism and the key tile of the
// prefill; its boundaries are absolute positions, never derived from the batch,
// the thread count or the query length ("batch-dependent split size" is a bug).
constexpr int kChunk = 256;
// Lanes of the score dot product (one AVX-512 register of floats).
constexpr int kLanes = 16;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kLog2e = 1.4426950408889634f;

// Fused where the hardware fuses; otherwise multiply then add. Chosen here, once,
// never by the compiler, so every call site rounds the same way.
inline float fmadd(float a, float b, float c) {
#if defined(__FMA__) || defined(__aarch64__)
  return __builtin_fmaf(a, b, c);
#else
  return a * b + c;
#endif
}

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

// 2^x for the arguments the kernels produce (x <= 0: a score minus a running max).
// Round-to-nearest split x = n + f, |f| <= 1/2, and Cephes' exp2f minimax polynomial
// for 2^f (relative error about 2e-7). exp2(0) is exactly 1; x < -126 gives 0;
// NaN stays NaN so poisoned inputs are never hidden.
inline float exp2_nonpositive(float x) {
  const float xc = x >= -127.f ? x : -127.f;  // NaN also lands here, result chosen below
  const float r = (xc + 12582912.f) - 12582912.f;  // 1.5 * 2^23: round to integer
  const float f = xc - r;
  float p = 1.535336188319500e-4f;
  p = fmadd(p, f, 1.339887440266574e-3f);
  p = fmadd(p, f, 9.618437357674640e-3f);
  p = fmadd(p, f, 5.550332471162809e-2f);
  p = fmadd(p, f, 2.402264791363012e-1f);
  p = fmadd(p, f, 6.931472028550421e-1f);
  p = fmadd(p, f, 1.0f);
  const int32_t n = static_cast<int32_t>(r);
  const float two_n = bits_to_float(static_cast<uint32_t>(n + 127) << 23);
  const float y = p * two_n;
  return x >= -126.f ? y : (x < -126.f ? 0.f : x);
}

// Element types of the pools, the query and the output. load() widens to float
// exactly; store() rounds to nearest even, once, at the very end.
struct F32 {
  using T = float;
  static float load(float x) { return x; }
  static float store(float x) { return x; }
};

struct BF16 {
  using T = uint16_t;
  static float load(uint16_t x) { return bits_to_float(uint32_t(x) << 16); }
  static uint16_t store(float x) {
    if (x != x) return 0x7FC0;
    uint32_t u = float_to_bits(x);
    u += ((u >> 16) & 1u) + 0x7FFFu;
    return static_cast<uint16_t>(u >> 16);
  }
};

struct F16 {
  using T = uint16_t;
  static float load(uint16_t x) {
    _Float16 h;
    std::memcpy(&h, &x, sizeof h);
    return static_cast<float>(h);
  }
  static uint16_t store(float x) {
    const _Float16 h = static_cast<_Float16>(x);
    uint16_t u;
    std::memcpy(&u, &h, sizeof u);
    return u;
  }
};

// Element codes of quantized pools (contract/kv_format.py): load() decodes a code to
// float32 exactly, without its scale (the kernel applies the scales once per key: to the
// score for K, to the softmax weight for V; kernel.h). No store(): only the write path
// (pool_update.cpp) encodes.
struct FP8E4M3 {  // float8_e4m3fn: bias 7, no inf, 0x7f / 0xff NaN, max 448
  using T = uint8_t;
  static float load(uint8_t x) {
    if ((x & 0x7F) == 0x7F) return bits_to_float((x & 0x80u) << 24 | 0x7FC00000u);
    // Its magnitude bits sit in a float16 three places lower than a float16's own
    // (exponent bias 15, not 7): the float16 with the same bits, times 2^8. Subnormals
    // (exponent 0) map to float16 subnormals with the same rule.
    return F16::load(static_cast<uint16_t>((x & 0x80u) << 8 | (x & 0x7Fu) << 7)) * 256.f;
  }
};

struct FP8E5M2 {  // float8_e5m2: the top byte of a float16 (inf, NaN as IEEE)
  using T = uint8_t;
  static float load(uint8_t x) { return F16::load(static_cast<uint16_t>(x << 8)); }
};

struct I8 {  // symmetric int8
  using T = int8_t;
  static float load(int8_t x) { return static_cast<float>(x); }
};

// Whether E is a quantized pool code (its rows carry scales) rather than a float type.
template <class E>
constexpr bool kQuantized = std::is_same_v<E, FP8E4M3> || std::is_same_v<E, FP8E5M2> || std::is_same_v<E, I8>;

// The lane fold every reduction here ends with: halving, i += i+8, i += i+4,
// i += i+2, i += i+1; the result is lane 0.
inline float fold_lanes(float* acc) {
  for (int w = kLanes / 2; w >= 1; w /= 2) {
    for (int i = 0; i < w; ++i) acc[i] += acc[i + w];
  }
  return acc[0];
}

#if defined(__AVX512F__)
// fold_lanes on a vector's 16 lanes: the same adds (lane i + lane i + w for w = 8, 4, 2,
// 1) in registers, not 15 dependent scalar adds through memory (those were 1.9% of a
// prefill L = S = 2048 f32 on the Zen 5 machine: one fold a row and chunk).
inline float fold_lanes16(__m512 v) {
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(3, 2, 3, 2)));
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(1, 1, 1, 1)));
  v = _mm512_add_ps(v, _mm512_permute_ps(v, _MM_SHUFFLE(3, 2, 3, 2)));
  v = _mm512_add_ps(v, _mm512_permute_ps(v, _MM_SHUFFLE(1, 1, 1, 1)));
  return _mm512_cvtss_f32(v);
}
#endif

// The score dot product: lane i accumulates d = i, i+16, i+32, ... in ascending
// order (a short D leaves the upper lanes at zero), then fold_lanes. The key row may be
// any element type E: it is widened exactly, element by element, as it is read.
template <class E = F32>
inline float dot16(const float* q, const typename E::T* k, int D) {
  float acc[kLanes] = {};
  int d = 0;
  for (; d + kLanes <= D; d += kLanes) {
    for (int i = 0; i < kLanes; ++i) acc[i] = fmadd(q[d + i], E::load(k[d + i]), acc[i]);
  }
  for (int i = 0; d + i < D; ++i) acc[i] = fmadd(q[d + i], E::load(k[d + i]), acc[i]);
  return fold_lanes(acc);
}

// Sum of p[0 .. n) where p[i] belongs to absolute key position first + i: lane k adds
// the keys at positions == k (mod 16) in ascending order, then fold_lanes. Lanes follow
// absolute positions, so every row that sees the same keys gets the same sum, however
// its chunk was clipped. The AVX-512 build sums as it makes the weights instead
// (exp2_lanes.h exp2_shifted, the same bits); this is the plain build's.
inline float lane_sum(const float* p, int first, int n) {
  float acc[kLanes] = {};
  int i = 0;
  for (; i < n && (first + i) % kLanes != 0; ++i) acc[(first + i) % kLanes] += p[i];
  for (; i + kLanes <= n; i += kLanes) {
    for (int k = 0; k < kLanes; ++k) acc[k] += p[i + k];
  }
  for (; i < n; ++i) acc[(first + i) % kLanes] += p[i];
  return fold_lanes(acc);
}

// Largest of p[0 .. n), n >= 1 (exact in any order).
inline float max_of(const float* p, int n) {
  float acc[kLanes];
  for (int k = 0; k < kLanes; ++k) acc[k] = p[0];
  int i = 0;
#if defined(__AVX512F__)  // vmaxps(x, y) is x > y ? x : y, lane by lane: the same selections
  if (i + kLanes <= n) {
    __m512 v = _mm512_loadu_ps(acc);
    for (; i + kLanes <= n; i += kLanes) v = _mm512_max_ps(_mm512_loadu_ps(p + i), v);
    _mm512_storeu_ps(acc, v);
  }
#endif
  for (; i + kLanes <= n; i += kLanes) {
    for (int k = 0; k < kLanes; ++k) acc[k] = p[i + k] > acc[k] ? p[i + k] : acc[k];
  }
  for (; i < n; ++i) acc[0] = p[i] > acc[0] ? p[i] : acc[0];
  float m = acc[0];
  for (int k = 1; k < kLanes; ++k) m = acc[k] > m ? acc[k] : m;
  return m;
}

// o[d] += p * v[d], one fused multiply-add per element (v widened exactly as read).
template <class E>
inline void axpy(float p, const typename E::T* v, float* o, int D) {
  for (int d = 0; d < D; ++d) o[d] = fmadd(p, E::load(v[d]), o[d]);
}

// Fold a chunk's state into the accumulated one. A state is (m, l, o): the max signed
// score m (unscaled, see Problem::qk_scale), the denominator l and the unnormalized
// output o[D]; l == 0 marks "no key seen". The first chunk is copied, so the result
// never depends on an identity element or on -inf arithmetic.
inline void merge_state(float& acc_m, float& acc_l, float* acc_o, float part_m, float part_l,
                        const float* part_o, int D, float qk_scale) {
  if (part_l == 0.f) return;
  if (acc_l == 0.f) {
    acc_m = part_m;
    acc_l = part_l;
    for (int d = 0; d < D; ++d) acc_o[d] = part_o[d];
    return;
  }
  const float m = acc_m > part_m ? acc_m : part_m;
  const float a = exp2_nonpositive((acc_m - m) * qk_scale);
  const float b = exp2_nonpositive((part_m - m) * qk_scale);
  acc_m = m;
  acc_l = fmadd(part_l, b, acc_l * a);
  for (int d = 0; d < D; ++d) acc_o[d] = fmadd(part_o[d], b, acc_o[d] * a);
}

// Fold a sink into a row's merged state, once per row: a logit sigma (in the units of
// m, i.e. logit mode) that adds e^(sigma - m) to the denominator and nothing to o. The
// max becomes max(m, sigma); where it stays m, a == 1 and o keeps its bits.
inline void add_sink(float& m, float& l, float* o, float sigma, int D, float qk_scale) {
  const float top = m > sigma ? m : sigma;
  const float a = exp2_nonpositive((m - top) * qk_scale);
  const float b = exp2_nonpositive((sigma - top) * qk_scale);
  m = top;
  l = fmadd(l, a, b);
  for (int d = 0; d < D; ++d) o[d] = o[d] * a;
}

// out = o * (1 / l), cast once. A row that saw no key is an empty batch slot: zeros.
template <class E>
inline void finish_row(float l, const float* o, typename E::T* out, int D) {
  const float inv = l == 0.f ? 0.f : 1.f / l;
  for (int d = 0; d < D; ++d) out[d] = E::store(o[d] * inv);
}

}  // namespace pagecheck
