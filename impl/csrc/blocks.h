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
#pragma once

#include <algorithm>
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
// Query rows a value pass weighs at once (weigh_rows): 6 x 4 accumulators, 4 V rows' vectors
// and a broadcast hold 29 of the 32 registers.
constexpr int kWeighRows = 6;

#if defined(__AVX512F__)
// Keeps v in a register from here on (an empty asm that "changes" it): GCC otherwise
// folds a loaded vector into every multiply-add that uses it (vfmadd231ps with a memory
// operand), so scores16_block issued 20 vector loads per 16 FMAs instead of 8 and the
// loads, not the multiply-adds, bounded it. Changes no value.
inline void in_register(__m512& v) { asm("" : "+v"(v)); }
inline void in_register(__m512i& v) { asm("" : "+v"(v)); }

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
#endif

#if defined(__AVX512F__)
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
