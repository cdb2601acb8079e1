// The value passes of one chunk (chunk.h attend_chunk's last step): the weighted values
// o[d] += p_j v_j[d], j ascending, of the rows' softmax numerators. A decode weighs span
// by span, head by head, its V rows read in place (weigh_in_spans, value_span, value_asks);
// a prefill group by group over the whole chunk (weigh_by_group). Both take the rows that
// see the same keys together (weigh_in_groups, RowGroup); the loops themselves are
// value_loops.h's.
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>

#include "kernel.h"
#include "kernel_info.h"

namespace pagecheck {

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

}  // namespace pagecheck
