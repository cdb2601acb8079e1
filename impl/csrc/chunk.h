// The attention of one chunk of keys for a group of query rows, on the float32 FMA
// path: the blocked walk of the pool (for_blocks_ahead), the scores, the softmax and the
// weighted values (attend_chunk), and clip_to_chunk, which both schedules (decode.cpp,
// prefill.cpp) call per chunk. The value passes are value_pass.h's; a prefill's scores
// walk transposed K (transposed_walk.h);
// the problem, the block-table walk and the per-thread scratch they use are kernel.h's;
// the bfloat16 tile path is amx.h's.
#pragma once

#include <algorithm>
#include <cstdint>

#include "kernel.h"
#include "kernel_info.h"
#include "pair_dots.h"
#include "transposed_walk.h"
#include "value_pass.h"

namespace pagecheck {

// Whether a KV head's `rows_per_head` query rows score its bfloat16 blocks on the pair dot
// product (pair_dots.h): up to kRowBlock rows from the pool's rows, more (a decode's
// longer queries, G x L rows) from a copy of each block in pair order made once for all
// their row groups (pair_block); from kTransposeRows on, the block is transposed instead.
// Mixed batch B 4 S 1024 bf16 pages of 16 (half the requests L 4: 16 rows a head), AMD,
// 2 threads, against the FMA loop on blocks widened once: 1.15-1.27 -> 0.99-1.08 ms.
template <class E>
inline bool pairs_apply(int rows_per_head, int D) {
  return std::is_same_v<E, BF16> && rows_per_head < kTransposeRows && D % 32 == 0 && pair_dots_enabled();
}

// A block's K rows as the score loop reads them. Few rows per block (a decode head's
// GQA group): in place, a half type widened in registers as each vector is loaded, so
// no widening pass through memory. Many (a decode's longer queries): widened once into
// float32 scratch, then reused by every row group; float32 rows are copied there only
// when they start mid cache line (read_in_place); bfloat16 rows on the pair dot product
// are put in pair order once instead (pair_block). At least kTransposeRows (a prefill):
// not these, but score_transposed. Widening, copying, pairing and transposing are exact
// and every loop adds in the fold's pairs, so every way gives the same bits.
template <class E>
struct BlockRows {
  using T = typename E::T;
  const T* in_pool[kBlock];
  const float* widened[kBlock];
  const uint16_t* ordered[kBlock];  // in pair order (pair_block), where `paired`
  bool use_widened = false;
  bool paired = false;      // ordered holds the block, which passed pair_block's guard

  // pairs: the rows of this head may be scored on the pair dot product (attend_chunk's
  // `pairs`); next: the pool rows of the block read after this one (ask_next), or null.
  void point(const T* pool, const int64_t* off, int n, int D, int rows_per_head, bool pairs, Scratch& s,
             const T* const* next) {
    paired = false;
    use_widened = false;
    pool_rows<E>(pool, off, n, s.zero_row<T>(), in_pool);
    if (rows_per_head <= kRowBlock) return;  // one call of the loop: read in place
    if constexpr (std::is_same_v<E, BF16>) {
      // Put in pair order once for all row groups (pair_block). A block that fails the
      // guard (an element below 2^-51: rare) is scored by the FMA loop from the pool's
      // rows, widened in registers by each row group.
      if (pairs) {
        paired = pair_block(in_pool, D, reinterpret_cast<uint16_t*>(s.block.data()), ordered, next);
        return;
      }
    }
    use_widened = !read_in_place<E>(pool + off[0], D);
    if (use_widened) widen_rows<E>(pool, off, n, D, s.block.data(), s.zeros.data(), widened);
  }
  // next: the pool rows of the block read after this one, asked for while this one
  // computes (ask_next), or null. A widened block is reused by many row groups, so its
  // loads are few and it asks for nothing.
  void scores(const float* const* q, int nr, int D, float* const* out, const T* const* next) const {
    if (use_widened) scores16_rows<F32>(q, nr, widened, D, out);
    else scores16_rows<E>(q, nr, in_pool, D, out, next);
  }
  // scores() from queries in pair order (pair_dots.h) where the block is bfloat16 rows
  // read in place; false where it is not or one of its K elements is tiny (out written
  // but not for use: then scores() is the way).
  bool pair_scores(const uint16_t* const* qp, int nr, int D, float* const* out, const T* const* next) const {
    if constexpr (std::is_same_v<E, BF16>) {
      if (paired) return scores16_pairs_rows<true>(qp, nr, ordered, D, out, nullptr);
      if (!use_widened) return scores16_pairs_rows(qp, nr, in_pool, D, out, next);
    }
    return false;
  }
};

// Calls visit(h, jb, n) for every head h < heads and every block [jb, jb + n) of at most
// kBlock keys of [jlo, jhi), in the pool's address order (a page is [Hkv, page_size, D]):
// page by page, and within a page head by head, so a call streams whole pages rather
// than one head's slice of each (too short for the hardware prefetcher). Pages smaller
// than a block are not worth splitting at: then the blocks run over the whole range,
// heads innermost. Every head still sees its keys in ascending order.
template <class Visit>
inline void for_blocks(const Problem& pr, int jlo, int jhi, int heads, Visit&& visit) {
  const int ps = pr.page_size;
  if (ps < kBlock) {
    for (int jb = jlo; jb < jhi; jb += kBlock)
      for (int h = 0; h < heads; ++h) visit(h, jb, std::min(kBlock, jhi - jb));
    return;
  }
  for (int s0 = jlo; s0 < jhi;) {
    const int s1 = std::min(jhi, (s0 / ps + 1) * ps);  // the end of s0's page
    for (int h = 0; h < heads; ++h)
      for (int jb = s0; jb < s1; jb += kBlock) visit(h, jb, std::min(kBlock, s1 - jb));
    s0 = s1;
  }
}

// for_blocks one block behind: visit(h, jb, n, next) also gets the pool rows of the
// block visited after it (null for the last one), so that it can ask for them while it
// computes (ask_next): the hardware prefetcher alone stops running ahead whenever the
// loads pause for the multiply-adds, so without this the time for memory and the time
// for arithmetic add up instead of overlapping.
// head_stride: elements between two KV heads' slices of a page in `pool`.
template <class E, class Visit>
inline void for_blocks_ahead(const Problem& pr, const typename E::T* pool, const int64_t* off, int jlo, int jhi,
                             int heads, int64_t head_stride, const typename E::T* zero_row, Visit&& visit) {
  using T = typename E::T;
  const T* next[kBlock];
  int h0 = -1, jb0 = 0, n0 = 0;  // the block waiting for its successor
  for_blocks(pr, jlo, jhi, heads, [&](int h, int jb, int n) {
    if (h0 >= 0) {
      pool_rows<E>(pool + h * head_stride, off + (jb - jlo), n, zero_row, next);
      visit(h0, jb0, n0, next);
    }
    h0 = h;
    jb0 = jb;
    n0 = n;
  });
  if (h0 >= 0) visit(h0, jb0, n0, nullptr);
}

// Attention of `rows` query rows over the keys of one chunk, for `heads` consecutive KV
// heads: rows [h * rows / heads, (h + 1) * rows / heads) read KV head h (counted from the
// head `off` points at), query head by query head, the same positions for each, in
// ascending order (weigh_in_groups takes them position by position). clo/chi: each row's
// visible keys clipped to the chunk (clo >= chi: none); [jlo, jhi): their union; off,
// voff: the K and V row offsets of keys jlo .. jhi-1 of the first head. In logit mode the
// scores become logits (to_logits, reading s.heads and s.pos). Writes each row's chunk
// state: ml[2r] = m, ml[2r+1] = l (0 when the row sees no key here), o[r*Dv ...]. K/V
// come in blocks of up to 16 keys (for_blocks) so a block is loaded (and widened) once
// for all rows of the GQA group, and each block asks for the next one while it computes
// (for_blocks_ahead).
// The values: span by span (weigh_in_spans, in place); values_by_group: group by group
// over the whole chunk instead (weigh_by_group, widened once where a half type; for
// callers with many rows per head whose K/V stay in cache: the prefill).
// Keys a row cannot see are never used, and keys outside [jlo, jhi) never read: their
// slots may hold NaN (REFERENCE.md invariant 9).
template <class E>
void attend_chunk(const Problem& pr, const typename E::T* kpool, const typename E::T* vpool,
                  const int64_t* off, const int64_t* voff, int jlo, int jhi, const float* q32, int rows,
                  int heads, const int* clo, const int* chi, Scratch& s, float* ml, float* o,
                  bool values_by_group = false) {
  using T = typename E::T;
  const int D = pr.D, Dv = pr.Dv, per_head = rows / heads;
  const int64_t stride = Scratch::kScoreStride;
  const int64_t head_stride = pr.head_slice();
  const int64_t value_stride = pr.value_slice();
  BlockRows<E> block;
  for (int r = 0; r < rows; ++r) {
    ml[2 * r] = kNegInf;
    ml[2 * r + 1] = 0.f;
    // Both value passes start each row that sees a key from zero in registers at its
    // first keys (fresh); a row that sees none keeps l == 0, so merge_state never reads
    // its o (and a one-chunk request's rows all see a key: their own position). Zeroing
    // o here first cost a memset of every task's rows: 3.8% of a B 4 S 128 f32 decode's
    // samples.
  }
  if constexpr (kQuantized<E>) {
    // One scale per (head, key), looked up once here: K's with the score's sign folded in
    // (exact), so each score is multiplied once.
    s.key_scales.resize(static_cast<size_t>(heads) * kChunk);
    s.value_scales.resize(static_cast<size_t>(heads) * kChunk);
    chunk_scales(pr, pr.k_scales, s.slots.data(), jhi - jlo, heads, pr.score_sign, s.key_scales.data());
    chunk_scales(pr, pr.v_scales, s.slots.data(), jhi - jlo, heads, 1.f, s.value_scales.data());
  }
  // The rows' queries in pair order, where a bfloat16 block read in place may score them
  // on the pair dot product (pair_dots.h): a row that fails pair_query's guard, and any
  // block scored with it, take the FMA loop.
  const bool pairs = pairs_apply<E>(per_head, D);
  if (pairs) {
    s.q_pairs.resize(static_cast<size_t>(rows) * D);
    s.q_pairs_ok.resize(rows);
    for (int r = 0; r < rows; ++r)
      s.q_pairs_ok[r] = pair_query(q32 + static_cast<int64_t>(r) * D, D, s.q_pairs.data() + static_cast<int64_t>(r) * D);
  }
  // A float32 value pass that copies the chunk's V rows after the softmax (pool rows
  // that start mid cache line, as MLX's do) gets them from L2 instead of L3 when they
  // are asked for as their keys are scored: L 2048 prefill, 2 threads, 120.4 -> 117.9
  // ms. Measured and left out: asking for rows read in place (2% slower) or for
  // half-type rows (3% slower).
  const auto asks_values = [&](int h) {
    return std::is_same_v<E, F32> && values_by_group && !read_in_place<E>(vpool + h * value_stride + voff[0], Dv);
  };
#if defined(__AVX512F__)
  if (per_head >= kTransposeRows && D % kLanes == 0) {
    score_transposed<E>(pr, kpool, vpool, asks_values, off, voff, jlo, jhi, q32, rows, heads, clo, chi, s);
  } else
#endif
  {
    const T* zero_row = s.zero_row<T>();
    for_blocks_ahead<E>(pr, kpool, off, jlo, jhi, heads, head_stride, zero_row,
                        [&](int h, int jb, int n, const T* const* next) {
      const T* kh = kpool + h * head_stride;
      block.point(kh, off + (jb - jlo), n, D, per_head, pairs, s, next);
      if (asks_values(h)) ask_rows(vpool + h * value_stride, voff + (jb - jlo), n, Dv);
      // The rows of this head that see a key of this block, kRowBlock at a time.
      const float* qs[kRowBlock];
      const uint16_t* qp[kRowBlock];
      float* ss[kRowBlock];
      int nsel = 0;
      bool paired = pairs;  // every selected row passed pair_query
      const auto score_selected = [&] {
        if (!(paired && block.pair_scores(qp, nsel, D, ss, next))) block.scores(qs, nsel, D, ss, next);
        next = nullptr;  // asked for by the first rows
        paired = pairs;
        scale_scores<E>(pr, s, h, jb - jlo, n, ss, nsel);
        nsel = 0;
      };
      for (int r = h * per_head; r < (h + 1) * per_head; ++r) {
        if (clo[r] >= jb + n || chi[r] <= jb) continue;
        qs[nsel] = q32 + static_cast<int64_t>(r) * D;
        if (pairs) {
          qp[nsel] = s.q_pairs.data() + static_cast<int64_t>(r) * D;
          paired = paired && s.q_pairs_ok[r];
        }
        ss[nsel++] = s.scores.data() + r * stride + (jb - jlo);
        if (nsel == kRowBlock) score_selected();
      }
      if (nsel > 0) score_selected();  // the last rows that see this block, fewer than kRowBlock
    });
  }
  // Softmax numerators and denominators, per row, over its visible keys only.
  for (int r = 0; r < rows; ++r) {
    if (clo[r] >= chi[r]) continue;
    float* sc = s.scores.data() + r * stride + (clo[r] - jlo);  // key clo[r] onwards
    const int n = chi[r] - clo[r];
    if (pr.logits) to_logits(pr, s.heads[r], s.pos[r], clo[r], sc, n);
    const float m = max_of(sc, n);
    ml[2 * r] = m;
    ml[2 * r + 1] = exp2_shifted(sc, n, m, pr.qk_scale, clo[r]);
    if constexpr (kQuantized<E>) {  // V's scale, once per weight, after the denominator took it
      const float* vs = s.value_scales.data() + (r / per_head) * kChunk + (clo[r] - jlo);
      for (int k = 0; k < n; ++k) sc[k] *= vs[k];
    }
  }
  // Weighted values, ascending j for every row.
  if (values_by_group) {
    weigh_by_group<E>(pr, vpool, voff, jlo, jhi, rows, heads, clo, chi, s, o);
    return;
  }
  weigh_in_spans<E>(pr, vpool, voff, jlo, jhi, rows, heads, clo, chi, s, o);
}

// Clip every row's span to chunk c; returns the union [jlo, jhi) (empty: jlo >= jhi).
inline void clip_to_chunk(int c, int rows, const int* lo, const int* hi, int* clo, int* chi,
                          int& jlo, int& jhi) {
  const int c0 = c * kChunk, c1 = c0 + kChunk;
  jlo = c1;
  jhi = c0;
  for (int r = 0; r < rows; ++r) {
    clo[r] = std::max(lo[r], c0);
    chi[r] = std::min(hi[r], c1);
    if (clo[r] < chi[r]) {
      jlo = std::min(jlo, clo[r]);
      jhi = std::max(jhi, chi[r]);
    }
  }
}

}  // namespace pagecheck
