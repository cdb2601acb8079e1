// A pool row's 16-element vectors, as the inner loops (blocks.h) use them: loaded and
// widened to float32 (load16: exact for every element type), kept in registers
// (in_register), summed lane pair by lane pair (the fold_* helpers of scores16's tree), and
// the next block's lines asked for while this one computes (ask_next, ask_rows).
#pragma once

#include <cstdint>
#include <type_traits>

#include "numerics.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace pagecheck {

constexpr int kBlock = 16;  // keys per block

#if defined(__AVX512F__)
// Lane pairs (i, i + w) of one accumulator are summed by "x + y" where x gathers the
// i lanes and y the i + w lanes; these helpers build x and y for two inputs at a time.
inline __m512 fold_halves(__m512 a, __m512 b) {  // w = 8: a's and b's 256-bit halves
  const __m512 x = _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0));
  const __m512 y = _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2));
  return _mm512_add_ps(x, y);
}

inline __m512 fold_quarters(__m512 a, __m512 b) {  // w = 4 within each 8-lane key
  const __m512 x = _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0));
  const __m512 y = _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1));
  return _mm512_add_ps(x, y);
}

inline __m512 fold_pairs(__m512 a, __m512 b) {  // w = 2 within each 4-lane key
  const __m512i lo = _mm512_setr_epi64(0, 2, 4, 6, 8, 10, 12, 14);
  const __m512i hi = _mm512_setr_epi64(1, 3, 5, 7, 9, 11, 13, 15);
  const __m512d ad = _mm512_castps_pd(a), bd = _mm512_castps_pd(b);
  const __m512 x = _mm512_castpd_ps(_mm512_permutex2var_pd(ad, lo, bd));
  const __m512 y = _mm512_castpd_ps(_mm512_permutex2var_pd(ad, hi, bd));
  return _mm512_add_ps(x, y);
}

inline __m512 fold_singles(__m512 a, __m512 b) {  // w = 1 within each 2-lane key
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  return _mm512_add_ps(_mm512_permutex2var_ps(a, even, b), _mm512_permutex2var_ps(a, odd, b));
}

inline __m512 fma16(__m512 a, __m512 b, __m512 c) {
#if defined(__FMA__)
  return _mm512_fmadd_ps(a, b, c);
#else
  return _mm512_add_ps(_mm512_mul_ps(a, b), c);
#endif
}

// 16 elements of a pool row, widened to float32 (exact: E::load lane by lane).
template <class E>
inline __m512 load16(const typename E::T* p) {
  if constexpr (std::is_same_v<E, F32>) {
    return _mm512_loadu_ps(p);
  } else if constexpr (std::is_same_v<E, BF16>) {
#if defined(__AVX512BW__)
    // Element i to the high half of lane i, zeros below: one word permute where a widening
    // and a shift took two vector ops per load (AMD machine, B 1 S 1024 pages of 16, 2
    // threads: bf16 decode 0.179 -> 0.137-0.178 ms, slower than float32's 0.153 before).
    const __m512i to_high = _mm512_set_epi16(15, 0, 14, 0, 13, 0, 12, 0, 11, 0, 10, 0, 9, 0, 8, 0, 7, 0, 6, 0, 5, 0,
                                             4, 0, 3, 0, 2, 0, 1, 0, 0, 0);
    const __m512i h = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, to_high, h));
#else
    const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
#endif
  } else if constexpr (std::is_same_v<E, F16>) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  } else if constexpr (std::is_same_v<E, I8>) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  } else if constexpr (std::is_same_v<E, FP8E5M2>) {
    const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm512_cvtph_ps(_mm256_slli_epi16(w, 8));
  } else {
    static_assert(std::is_same_v<E, FP8E4M3>);
    // FP8E4M3::load on 16 lanes. Sign-extended to 16 bits and shifted 7 up, a code's
    // magnitude lands on a float16's bits 7..13 and its sign on bit 15; bit 14 (a copy of
    // the sign) is cleared. Times 2^8 (exact). Three integer operations where masking
    // sign and magnitude apart took six: the decode is most of a fp8 decode's extra work.
    const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i h = _mm256_and_si256(_mm256_slli_epi16(w, 7), _mm256_set1_epi16(static_cast<short>(0xBFFF)));
    const __m512 x = _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.f));
    // NaN codes (magnitude 0x7f: bits 7..13 all set) are rare: a test, and the blend only
    // where one is present. The NaN keeps the code's sign and the scalar load's payload.
    const __m256i all7 = _mm256_set1_epi16(0x3F80);
    const __mmask16 nan = _mm256_cmpeq_epi16_mask(_mm256_and_si256(h, all7), all7);
    if (__builtin_expect(nan == 0, 1)) return x;
    const __m512 sign = _mm512_and_ps(x, _mm512_castsi512_ps(_mm512_set1_epi32(INT32_MIN)));
    return _mm512_mask_blend_ps(nan, x, _mm512_or_ps(sign, _mm512_castsi512_ps(_mm512_set1_epi32(0x7FC00000))));
  }
}

// Keeps v in a register from here on (an empty asm that "changes" it): GCC otherwise
// folds a loaded vector into every multiply-add that uses it (vfmadd231ps with a memory
// operand), so scores16_block issued 20 vector loads per 16 FMAs instead of 8 and the
// loads, not the multiply-adds, bounded it. Changes no value.
inline void in_register(__m512& v) { asm("" : "+v"(v)); }
inline void in_register(__m512i& v) { asm("" : "+v"(v)); }
#endif

// Prefetch hint of ask_next and ask_rows: into L2 (prefetcht1), not L1. A decode from
// DRAM (B 16, S 8192, page 16, f32, 2 threads) read 28.4 GB/s with prefetches into L1
// and 30.5 GB/s into L2 (19.7 with none); the first use of each line then hits L2. On the
// AMD machine the same decode read 19 GB/s with prefetches into L1 against 28-29 into L2
// (prefetcht2 as prefetcht1).
constexpr int kPrefetchLocality = 2;

// Asks for the cache line of the next block's row that matches the 16 elements a loop
// is loading now from this block's row (once per line: every second load of a half
// type). Spread this way, one request per line consumed, the next block streams in
// while this one computes; asked all at once, the requests would queue behind each
// other and the multiply-adds would wait for memory instead of overlapping it.
// `next` may be null (nothing to ask for); prefetches change no value.
template <class E>
inline void ask_next(const typename E::T* const* next, int row, int d) {
  constexpr int kLineElems = 64 / static_cast<int>(sizeof(typename E::T));
  if (next != nullptr && d % kLineElems == 0) {
    __builtin_prefetch(next[row] + d, 0, kPrefetchLocality);
  }
}

// Asks for every line of n pool rows of D elements at once: for rows read long after
// (a prefill's V rows, asked for while its many query rows score the matching K
// rows), where queueing does not matter.
template <class T>
inline void ask_rows(const T* pool, const int64_t* off, int n, int D) {
  constexpr int kLineElems = 64 / static_cast<int>(sizeof(T));
  for (int k = 0; k < n; ++k)
    for (int d = 0; d < D; d += kLineElems) __builtin_prefetch(pool + off[k] + d, 0, kPrefetchLocality);
}

}  // namespace pagecheck
