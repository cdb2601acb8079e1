// The attention of one chunk of keys for a group of query rows, on the float32 FMA
// path: the blocked walk of the pool (for_blocks_ahead), the scores, the softmax and the
// weighted values (attend_chunk), and clip_to_chunk, which both schedules (decode.cpp,
// prefill.cpp) call per chunk. A prefill's scores walk transposed K (transposed_walk.h);
// the problem, the block-table walk and the per-thread scratch they use are kernel.h's;
// the bfloat16 tile path is amx.h's.
#pragma once

#include <algorithm>
#include <cstdint>

#include "kernel.h"
#include "kernel_info.h"
#include "pair_dots.h"
#include "transposed_walk.h"

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

// Up to kWeighRows rows that weigh the same keys [a, z) in one call (weigh_in_groups).
struct RowGroup {
  int a, z, n;
  bool fresh;  // these are the rows' first keys: nothing was added to their outputs before
  const float* p[kWeighRows];
  float* o[kWeighRows];
};

// Calls weigh(g) for the rows [r0, r1) that see keys of [w0, w1) (their spans clipped to
// it): g.p[i] points at row i's score of key g.a (scores start at key jlo), g.o[i] at its
// output; g.fresh: these are the rows' first keys (callers weigh ranges in ascending
// order). The rows are a KV head's, query head by query head, `positions` each; they are
// taken position by position, so their keys end in ascending order (a row sees keys up
// to its position), and Rows at a time while they start at the same key. A group weighs
// the keys all its rows see, then steps on over the rest, its rows whose keys end there
// left out at each step. Under a causal mask a chunk that reaches a query block's
// diagonal ends at a different key for every position: grouped by exact span its rows
// went G (4) a call, and at L = S = 512 pages of 128 (f32, AMD Zen 5) those groups took
// more of the prefill than its full groups of 6 (19.5% and 17% of the time in perf).
// Every output still adds p_j v_j for j ascending from its first key, one fused
// multiply-add each, stored after one step and loaded by the next: the same bits.
template <int Rows, class Weigh>
inline void weigh_in_groups(int r0, int r1, int positions, int w0, int w1, const int* clo, const int* chi, int jlo,
                            const float* scores, float* o, int D, Weigh&& weigh) {
  static_assert(Rows <= kWeighRows);
  const int heads = (r1 - r0) / positions;
  int rows[Rows];  // the group's rows, their keys ending in ascending order
  int n = 0, a = 0;
  bool fresh = false;
  const auto end = [&](int r) { return std::min(chi[r], w1); };
  const auto weigh_group = [&] {
    RowGroup g;
    g.a = a;
    g.fresh = fresh;
    for (int i = 0; i < n;) {  // rows [i, n) see keys [g.a, end(rows[i]))
      g.z = end(rows[i]);
      g.n = 0;
      for (int k = i; k < n; ++k) {
        g.p[g.n] = scores + static_cast<int64_t>(rows[k]) * Scratch::kScoreStride + (g.a - jlo);
        g.o[g.n++] = o + static_cast<int64_t>(rows[k]) * D;
      }
      weigh(static_cast<const RowGroup&>(g));
      while (i < n && end(rows[i]) == g.z) ++i;
      g.a = g.z;
      g.fresh = false;
    }
    n = 0;
  };
  for (int l = 0; l < positions; ++l) {
    for (int h = 0; h < heads; ++h) {
      const int r = r0 + h * positions + l;
      const int ra = std::max(clo[r], w0);
      if (ra >= end(r)) continue;
      const bool first_keys = clo[r] >= w0;
      if (n > 0 && (ra != a || first_keys != fresh)) weigh_group();
      if (n == 0) {
        a = ra;
        fresh = first_keys;
      }
      rows[n++] = r;
      if (n == Rows) weigh_group();
    }
  }
  if (n > 0) weigh_group();
}

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

// The weighted values of one chunk when a head has many rows (prefill): rows that see
// the same keys [a, z) of the chunk are weighed together, kWeighRows at a time, over all
// of those keys in one call, so their outputs stay in registers across the chunk instead
// of being loaded and stored again for every block of 16 keys (that traffic held the
// block-by-block loop at about half the multiply-add rate). Six rows, not four: each V
// vector loaded serves 6 multiply-adds (a chunk's V, 128 KiB a head, comes from L2 for
// every group); on the AMD Zen 5 machine the prefill L = S = 2048 f32 and bf16 ran 2-5%
// faster against vLLM's, in turns of processes. The chunk's V rows are read
// in place (float32) or widened once into scratch. Every output element still adds
// p_j v_j for j ascending from a, one fused multiply-add each: the same bits as the
// block-by-block walk. Where the rows' keys end at their positions (the chunk that
// reaches the diagonal) a group of 6 steps on over the keys its later positions see.
// Float32 rows that start mid cache line are copied too (read_in_place).
template <class E>
void weigh_by_group(const Problem& pr, const typename E::T* vpool, const int64_t* off, int jlo, int jhi,
                    int rows, int heads, const int* clo, const int* chi, Scratch& s, float* o) {
  const int D = pr.Dv, per_head = rows / heads, n = jhi - jlo;  // off: the V rows' offsets
  const float* values[kChunk];
  int64_t wide = 0;  // rows weighed in full groups
  for (int h = 0; h < heads; ++h) {
    const typename E::T* vh = vpool + h * pr.value_slice();
    const bool in_place = read_in_place<E>(vh + off[0], D);
    if constexpr (std::is_same_v<E, F32>) {
      if (in_place) pool_rows<F32>(vh, off, n, s.zeros.data(), values);
    }
    if (!in_place) {
      s.chunk_values.resize(static_cast<size_t>(kChunk) * D);
      widen_rows<E>(vh, off, n, D, s.chunk_values.data(), s.zeros.data(), values);
    }
    weigh_in_groups<kWeighRows>(h * per_head, (h + 1) * per_head, per_head / pr.group(), jlo, jhi, clo, chi, jlo,
                                s.scores.data(), o, D, [&](const RowGroup& g) {
                                  weigh_rows<F32>(values + (g.a - jlo), g.p, g.n, g.z - g.a, g.o, D, nullptr, g.fresh);
                                  if (g.n == kWeighRows) wide += g.n;
                                });
  }
  if (wide > 0) count_wide_value_rows(wide);  // one atomic add a chunk, for tests
}

// Keys a decode head weighs in one call (weigh_in_spans): a span of 32 KiB of its V
// rows (64 float32 keys of D 128, 128 bfloat16, 256 of 8-bit codes), at least a block
// and at most a chunk. Measured on the AMD machine (2 threads, paged_now, turns of
// blocks in one process, same bits throughout): spans of 256 float32 keys made a decode
// from memory 5-10% slower than block by block (B 4 S 8192, B 16 S 1024, B 1 S 8192),
// spans of 32 made calls from cache 5% slower than 64; 64 was within 3% of the better
// of the two on every shape timed.
// A call whose K/V bytes are at most kCachedKvBytes (in the 32 MiB L3 the AMD machine's
// 2 cores share, with room for the rest) weighs spans of 64 KiB (128 float32 keys, a
// whole chunk of bfloat16): its V rows come from cache, where fewer spans load and store
// the outputs less often. There, in turns in one process against 32 KiB spans (same
// bits): B 1 S 1024 pages of 16 bf16 0.1038 -> 0.1016 ms, pages of 128 bf16 0.1118 ->
// 0.1072, f32 pages of 16 0.1197 -> 0.1169 (a whole chunk: 0.1178), B 4 S 1024 bf16
// (16 MiB) 0.406 -> 0.403; beyond it they lose: B 4 S 1024 f32 (32 MiB) 0.643 -> 0.728,
// B 1 S 8192 bf16 1.019 -> 1.039, B 16 S 1024 bf16 (64 MiB) and B 4 S 8192 bf16 3.5-4%.
constexpr int64_t kCachedKvBytes = int64_t{16} << 20;

inline int value_span(int64_t value_row_bytes, int64_t kv_bytes) {
  const int64_t span_bytes = kv_bytes <= kCachedKvBytes ? 64 << 10 : 32 << 10;
  const int64_t keys = span_bytes / std::max<int64_t>(value_row_bytes, 1);
  return static_cast<int>(std::clamp<int64_t>(keys / kBlock * kBlock, kBlock, kChunk));
}

// Whether a decode's value pass asks for the V rows it weighs next (ask_next): not where
// the rows are 2-byte elements (widened in registers) and the call's K/V are at most
// kCachedKvBytes. From cache, the asks and their tests cost more than they hide there: on
// the AMD machine, 2 threads, builds in turns with vLLM timed in each process (same
// bits), bf16 pages of 16 B 1 S 1024 0.0987 -> 0.0966 ms, B 4 S 128 0.0547 -> 0.0536,
// B 16 S 128 0.2061 -> 0.2021, pages of 128 B 1 S 1024 0.1030 -> 0.0979; float32 rows
// lost (B 4 S 128 0.0591 -> 0.0599), and so did the score loop without its asks of K
// (B 1 S 1024 bf16 0.0966 -> 0.0998).
inline bool value_asks(int64_t element_bytes, int64_t kv_bytes) {
  return element_bytes != 2 || kv_bytes > kCachedKvBytes;
}

// The weighted values of one chunk for the decode schedule, its V rows read in place
// (a half type widened in registers): span by span of the chunk's keys (value_span),
// and within a span KV head by KV head, each group of a head's rows that see the same
// keys of the span (weigh_in_groups) weighs all of them in one call, so their outputs
// stay in registers across the span; block by block they were loaded and stored again
// for every 16 keys, with a row grouping and a call per block. Every output element
// still adds p_j v_j for j ascending, one fused multiply-add each onto the zeroed output:
// the same bits. While a head computes it asks for the rows read next (the next head's
// of the span, or the first head's of the next span; ask_next). On the AMD machine, 2
// threads, medians in turns against the block walk: B 1 S 1024 pages of 16 f32 0.197 ->
// 0.178 ms, bf16 0.190 -> 0.164, B 4 S 128 f32 0.105 -> 0.093, B 4 S 8192 bf16 7.07 ->
// 6.36, f32 from memory within 3% (B 1 S 8192 pages of 128 2.24 -> 2.31, B 16 S 1024
// 5.24 -> 5.27, B 4 S 8192 9.93 -> 9.67). Queries of 4 rows (G 4 L 4: 16 rows a head,
// whose blocks the block walk widened once for all of them), in one process against
// that walk: B 4 S 1024 pages of 16 bf16 3.56 -> 2.62 ms, a mixed batch (half of it
// L 4) bf16 1.96 -> 1.52, f32 2.79 -> 2.31, from memory (S 8192) bf16 16.9 -> 14.0,
// f32 pages of 128 19.7 -> 17.1.
template <class E>
void weigh_in_spans(const Problem& pr, const typename E::T* vpool, const int64_t* off, int jlo, int jhi, int rows,
                    int heads, const int* clo, const int* chi, Scratch& s, float* o) {
  using T = typename E::T;
  const int Dv = pr.Dv, per_head = rows / heads;
  const int span = value_span(static_cast<int64_t>(Dv) * static_cast<int64_t>(sizeof(T)), pr.kv_bytes);
  const bool asks = value_asks(sizeof(T), pr.kv_bytes);
  const T* zero_row = s.zero_row<T>();
  const T* first[kChunk];
  const T* second[kChunk];
  const T** now = first;    // the rows head h weighs: keys [w0, w1) of its V
  const T** ahead = second;  // the rows weighed after them: keys [a0, a1) of head ah
  int a0 = jlo, a1 = std::min(jhi, jlo + span), ah = 0;
  pool_rows<E>(vpool, off, a1 - a0, zero_row, ahead);
  for (int w0 = jlo; w0 < jhi; w0 += span) {
    const int w1 = std::min(jhi, w0 + span);
    for (int h = 0; h < heads; ++h) {
      std::swap(now, ahead);
      if (++ah == heads) {
        ah = 0;
        a0 = w1;
        a1 = std::min(jhi, w1 + span);
      }
      if (a0 < a1) pool_rows<E>(vpool + ah * pr.value_slice(), off + (a0 - jlo), a1 - a0, zero_row, ahead);
      const T* const* next = asks && a0 < a1 ? ahead : nullptr;
      weigh_in_groups<kRowBlock>(h * per_head, (h + 1) * per_head, per_head / pr.group(), w0, w1, clo, chi, jlo,
                                 s.scores.data(), o, Dv, [&](const RowGroup& g) {
                                   // The next rows at the same place as these, where the next span has them.
                                   const bool ask = next != nullptr && g.z - w0 <= a1 - a0;
                                   weigh_rows<E>(now + (g.a - w0), g.p, g.n, g.z - g.a, g.o, Dv,
                                                 ask ? next + (g.a - w0) : nullptr, g.fresh);
                                   next = nullptr;  // asked for by the first rows
                                 });
    }
  }
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
