// bfloat16 scores on AVX512-BF16's pair dot product (vdpbf16ps), with scores16_block's
// bits. One vdpbf16ps adds to each of its 16 float32 lanes two products of bfloat16
// pairs, the odd element's first: on this project's machines it equals two float32 FMAs
// in sequence, odd element first, except that subnormal inputs and results are flushed
// to zero (AMD machine: every one of 9.6 M random lanes, every exponent, infinities and
// NaN payloads included, matched two FMAs where no input was tiny; bench/fma_loops.cpp
// has no part in it). dot16's lane l adds d = l, l + 16, l + 32, ... in order, so a lane
// of the pair loop gets element l + 32 t in its odd slot and l + 16 + 32 t in its even
// slot (pair_order: one word permute per 32 K elements, and the query rows once per
// call): the same operations in the same order, half the multiply-add instructions.
//
// The flush is kept out by a guard, not emulated: every nonzero query and K element at
// least 2^-51 in magnitude (kTinyBits) makes each bfloat16 a multiple of 2^-58, each
// product and every partial sum a multiple of 2^-116, so nothing is subnormal and
// nothing is flushed. A query row that fails it never takes this loop (pair_query); a
// block whose K rows fail it is scored again by scores16_block (the caller), whose bits
// these are anyway. The float32 query rows of a bfloat16 pool are its bfloat16 query
// widened (the pools' type is the query's: kernel.h PAGECHECK_FOR_EACH_POOL_TYPE), so
// taking their high halves is exact.
//
// Where it pays: the AMD machine issues vdpbf16ps as fast as FMAs (1.6-1.8 per ns per
// core both), so the score loop needs half the multiply-add issue slots; the Intel
// machine issues it at a quarter of the FMA rate (1.87 against 7.6 per ns: half the
// multiply-adds), where a decode on it was 13% slower. Hence pair_dots_enabled (kernel_info.h): on by default on
// AMD CPUs only.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>

#include "blocks.h"

namespace pagecheck {

// |x| < 2^-51 and x != 0, as a bfloat16's magnitude bits (exponent field < 127 - 51).
constexpr uint16_t kTinyBits = (127 - 51) << 7;

// K blocks the pair loop refused (a tiny element: scored again by the FMA loop) since
// the module was loaded: counted where it refuses, never on the loop's way.
inline std::atomic<int64_t>& pair_refusals() {
  static std::atomic<int64_t> refused{0};
  return refused;
}

// The pair loop's order of 32 elements: slot 2l + 1 holds element l, slot 2l element
// l + 16 (what vdpbf16ps adds first sits in the odd slot).
constexpr int pair_source(int slot) { return slot % 2 == 1 ? slot / 2 : 16 + slot / 2; }

// word(pair_source(slot)) for the 32 slots: a permute's indices into pair order.
template <class Word>
constexpr std::array<uint16_t, 32> pair_words(Word word) {
  std::array<uint16_t, 32> w{};
  for (int slot = 0; slot < 32; ++slot) w[slot] = static_cast<uint16_t>(word(pair_source(slot)));
  return w;
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
inline constexpr bool kPairDotsBuilt = true;

// q (float32 widened from bfloat16, D % 32 == 0) as bfloat16 in pair order into qp;
// false where an element is tiny (then qp is not for use). Vectorized: a scalar loop
// over the 32 rows of a B 1 decode took about 4 us of a 20 us call at S 128.
inline bool pair_query(const float* q, int D, uint16_t* qp) {
  alignas(64) static constexpr auto kHighWords = pair_words([](int e) { return 2 * e + 1; });
  const __m512i high_words = _mm512_load_si512(kHighWords.data());
  __mmask32 tiny = 0;
  for (int t = 0; t < D; t += 32) {
    const __m512i a = _mm512_loadu_si512(q + t), b = _mm512_loadu_si512(q + t + 16);
    const __m512i pairs = _mm512_permutex2var_epi16(a, high_words, b);
    const __m512i mag = _mm512_and_si512(pairs, _mm512_set1_epi16(0x7FFF));
    tiny |= _mm512_test_epi16_mask(mag, mag) & _mm512_cmplt_epu16_mask(mag, _mm512_set1_epi16(kTinyBits));
    _mm512_storeu_si512(qp + t, pairs);
  }
  return tiny == 0;
}

// The guard over a block's K elements, in two looks. glance, as the loop loads them: the
// least magnitude seen, zeros included, as its bits shifted up one (x + x drops the
// sign): two integer ops per 32 K elements and no constant to hold (with a mask and a 1
// held, the fold state went through the stack). Only where that finds a magnitude below
// kTinyBits, a zero or a tiny element, does passed() look again at the block's rows,
// leaving zeros out (three ops a vector); a partial block's padding (zero rows) always
// takes that second look, once per block. The single look it replaces, three ops a
// vector as the loop loaded them, cost 3.3% of a B 1 S 1024 decode (AMD machine, 2
// threads, pages of 16, builds in turns: 0.1016 -> 0.0983 ms; no guard at all 0.0968).
struct KeyGuard {
  __m512i least = _mm512_set1_epi16(-1);
  __attribute__((always_inline)) void glance(__m512i raw) {
    least = _mm512_min_epu16(least, _mm512_add_epi16(raw, raw));
  }
  // No nonzero element of the block's `keys` rows (D elements each) is tiny, where every
  // element of them went through glance(). A block the pair loop refuses is counted
  // (pair_dots_refusals).
  bool passed(const uint16_t* const* rows, int keys, int D) const {
    if (below_tiny(least) == 0) return true;
    __m512i nonzero_least = _mm512_set1_epi16(-1);
    for (int k = 0; k < keys; ++k) {
      for (int d = 0; d < D; d += 32) {
        const __m512i raw = _mm512_loadu_si512(rows[k] + d), twice = _mm512_add_epi16(raw, raw);
        nonzero_least = _mm512_mask_min_epu16(nonzero_least, _mm512_test_epi16_mask(twice, twice), nonzero_least, twice);
      }
    }
    if (below_tiny(nonzero_least) == 0) return true;
    pair_refusals().fetch_add(1, std::memory_order_relaxed);
    return false;
  }

 private:
  static __mmask32 below_tiny(__m512i twice) { return _mm512_cmplt_epu16_mask(twice, _mm512_set1_epi16(2 * kTinyBits)); }
};

// pair_words' permute of 32 elements, as a vector of indices.
inline __m512i pair_order() {
  alignas(64) static constexpr auto kOrder = pair_words([](int e) { return e; });
  return _mm512_load_si512(kOrder.data());
}

// NR rows x 16 keys from bfloat16 K rows (D % 32 == 0), queries in pair order
// (pair_query): scores16_block's loop and fold with one vdpbf16ps where it had two FMAs.
// Rows in the pool (kOrdered false): each 32 K elements are guarded and put in pair
// order as they are loaded, shared by the NR rows; returns false, with s written but not
// for use, where an element is tiny (then the caller scores the block with
// scores16_block). Rows of pair_block (kOrdered true): loaded as they are; returns true.
template <int NR, bool kOrdered>
__attribute__((noinline)) bool scores16_pairs(const uint16_t* const* qp, const uint16_t* const* rows, int D,
                                              float* const* s, const uint16_t* const* next) {
  const __m512i order = pair_order();
  KeyGuard guard;
  KeyFold<NR> fold;
#pragma GCC unroll 4
  for (int k0 = 0; k0 < kBlock; k0 += 4) {
    __m512 a[NR][4];
    KeyFold<NR>::clear(a);
    for (int d = 0; d < D; d += 32) {
      __m512i kv[4];
      for (int i = 0; i < 4; ++i) {
        if constexpr (kOrdered) {
          kv[i] = _mm512_load_si512(rows[k0 + i] + d);
        } else {
          const __m512i raw = _mm512_loadu_si512(rows[k0 + i] + d);
          guard.glance(raw);
          kv[i] = _mm512_permutexvar_epi16(order, raw);
          ask_next<BF16>(next, k0 + i, d);
        }
        in_register(kv[i]);
      }
      for (int r = 0; r < NR; ++r) {
        __m512i qv = _mm512_loadu_si512(qp[r] + d);
        in_register(qv);
        for (int i = 0; i < 4; ++i) a[r][i] = _mm512_dpbf16_ps(a[r][i], (__m512bh)qv, (__m512bh)kv[i]);
      }
    }
    fold.add(k0 / 4, a);
  }
  fold.store(s);
  return kOrdered || guard.passed(rows, kBlock, D);
}

// A block's 16 K rows in pair order, once, for a head with more rows than one call of
// the loop takes (a decode's longer queries: G x L rows): into `out` (16 x D elements,
// 64-byte aligned), its rows' pointers into `ordered`. Each row group then loads them
// as they are (scores16_pairs<NR, true>), where each group guarded and permuted every K
// element again. False where an element is tiny (then the block takes scores16_block,
// from the pool's rows). next: as scores16_pairs'.
inline bool pair_block(const uint16_t* const* rows, int D, uint16_t* out, const uint16_t** ordered,
                       const uint16_t* const* next) {
  const __m512i order = pair_order();
  KeyGuard guard;
  for (int k = 0; k < kBlock; ++k) {
    uint16_t* row = out + static_cast<int64_t>(k) * D;
    for (int d = 0; d < D; d += 32) {
      const __m512i raw = _mm512_loadu_si512(rows[k] + d);
      guard.glance(raw);
      _mm512_store_si512(row + d, _mm512_permutexvar_epi16(order, raw));
      ask_next<BF16>(next, k, d);
    }
    ordered[k] = row;
  }
  return guard.passed(rows, kBlock, D);
}

// scores16_pairs for nr <= kRowBlock rows.
template <bool kOrdered = false>
inline bool scores16_pairs_rows(const uint16_t* const* qp, int nr, const uint16_t* const* rows, int D,
                                float* const* s, const uint16_t* const* next) {
  switch (nr) {
    case 1: return scores16_pairs<1, kOrdered>(qp, rows, D, s, next);
    case 2: return scores16_pairs<2, kOrdered>(qp, rows, D, s, next);
    case 3: return scores16_pairs<3, kOrdered>(qp, rows, D, s, next);
    default: return scores16_pairs<4, kOrdered>(qp, rows, D, s, next);
  }
}
#else
inline constexpr bool kPairDotsBuilt = false;

inline bool pair_query(const float*, int, uint16_t*) { return false; }

template <bool kOrdered = false>
inline bool scores16_pairs_rows(const uint16_t* const*, int, const uint16_t* const*, int, float* const*,
                                const uint16_t* const*) {
  return false;  // never called: pair_dots_enabled() is false in such a build
}

inline bool pair_block(const uint16_t* const*, int, uint16_t*, const uint16_t**, const uint16_t* const*) {
  return false;  // never called, as scores16_pairs_rows
}
#endif

}  // namespace pagecheck
