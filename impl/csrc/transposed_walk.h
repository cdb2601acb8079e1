// A prefill's scores: the walk of a chunk's K in transposed 16-key blocks, two at a time
// or one (score_transposed, for heads of kTransposeRows rows or more; the switch is in
// transposed_pairs.cpp), and the scaling every score walk applies after its loop
// (scale_scores: quantized K's scale, a negative scale's sign). chunk.h's attend_chunk
// calls them; the loops are transposed.h's.
#pragma once

#include <algorithm>
#include <cstdint>

#include "kernel.h"
#include "kernel_info.h"
#include "transposed.h"

namespace pagecheck {

// Rows of one KV head that see a block from which its K rows are transposed once
// (transpose_block, scores_transposed): the transposition costs about 770 vector ops a
// block of D 128 (per 16 x 16: 16 loads, 64 shuffles, 16 stores), the fold it saves 45
// a row (30 shuffles, 15 adds), so it pays from a few dozen rows and is left to the
// prefill (64 positions x G rows a head). Prefill L = S = 2048 f32 pages of 128, 2
// threads (perf): the score loop's share 42% -> 37% of the call, the transposes 0.6%.
constexpr int kTransposeRows = 64;

// Multiplies the scores of keys [jb, jb + n) of head h (ss[i]: row i's score of key jb;
// jb counted from the chunk's first key) by K's scale where the pool is quantized (the
// score's sign folded in: exact), by the sign where the scale is negative (exact); a
// positive float scale leaves them as they are (times +1 would change no bit).
template <class E>
inline void scale_scores(const Problem& pr, const Scratch& s, int h, int jb, int n, float* const* ss, int nr) {
  if constexpr (kQuantized<E>) {
    const float* ks = s.key_scales.data() + h * kChunk + jb;
    for (int i = 0; i < nr; ++i)
      for (int k = 0; k < n; ++k) ss[i][k] *= ks[k];
  } else if (pr.score_sign < 0.f) {
    for (int i = 0; i < nr; ++i)
      for (int k = 0; k < n; ++k) ss[i][k] *= pr.score_sign;
  }
}

#if defined(__AVX512F__)
// The scores of one chunk where a KV head has at least kTransposeRows rows (a prefill),
// head by head, in pairs of 16-key blocks where transposed_pairs_enabled() (else one
// block at a time: transposed.h says where each pays): each pair's K rows transposed once
// into scratch (transpose_block, widened as they go), then scored for every row that sees
// a key of the pair, kRowBlock rows at a time (scores_transposed: each broadcast query
// element serves both blocks; a chunk's last single block alone). A row that sees only
// part of a pair gets scores of the rest too, never read (its span is [clo, chi)); no
// key outside [jlo, jhi) is read. asks_values(h): whether to ask for head h's V rows of
// the same keys now (a float32 value pass that copies them: see attend_chunk).
template <class E, class AsksValues>
void score_transposed(const Problem& pr, const typename E::T* kpool, const typename E::T* vpool, AsksValues&& asks_values,
                      const int64_t* off, const int64_t* voff, int jlo, int jhi, const float* q32, int rows,
                      int heads, const int* clo, const int* chi, Scratch& s) {
  using T = typename E::T;
  const int D = pr.D, per_head = rows / heads, stride = Scratch::kScoreStride;
  float* const kt0 = s.block.data();
  float* const kt1 = kt0 + static_cast<int64_t>(kBlock) * D;
  const T* krows[kBlock];
  const int span = transposed_pairs_enabled() ? 2 * kBlock : kBlock;  // keys scored a call
  int64_t pairs = 0;
  for (int h = 0; h < heads; ++h) {
    const T* kh = kpool + h * pr.head_slice();
    const T* vh = vpool + h * pr.value_slice();
    const bool ask_values = asks_values(h);
    for (int jb = jlo; jb < jhi; jb += span) {
      const int n = std::min(span, jhi - jb);
      pool_rows<E>(kh, off + (jb - jlo), std::min(kBlock, n), s.zero_row<T>(), krows);
      transpose_block<E>(krows, D, kt0);
      if (n > kBlock) {
        pool_rows<E>(kh, off + (jb + kBlock - jlo), n - kBlock, s.zero_row<T>(), krows);
        transpose_block<E>(krows, D, kt1);
      }
      if (ask_values) ask_rows(vh, voff + (jb - jlo), n, pr.Dv);
      const float* qs[kRowBlock];
      float* ss[kRowBlock];
      int nsel = 0;
      pairs += n > kBlock;
      const auto score_selected = [&] {
        scores_transposed_rows(qs, nsel, kt0, n > kBlock ? kt1 : nullptr, D, ss);
        scale_scores<E>(pr, s, h, jb - jlo, n, ss, nsel);
        nsel = 0;
      };
      for (int r = h * per_head; r < (h + 1) * per_head; ++r) {
        if (clo[r] >= jb + n || chi[r] <= jb) continue;
        qs[nsel] = q32 + static_cast<int64_t>(r) * D;
        ss[nsel++] = s.scores.data() + r * stride + (jb - jlo);
        if (nsel == kRowBlock) score_selected();
      }
      if (nsel > 0) score_selected();
    }
  }
  if (pairs > 0) count_transposed_pairs(pairs);  // one atomic add a chunk, for tests
}
#endif

}  // namespace pagecheck
