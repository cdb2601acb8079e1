// What both schedules share: the problem description, the walk through the block
// table, and the per-chunk attention of a group of query rows.
//
//   symbol        meaning                                    layout
//   q             newest L positions of each request         [B, Hq, L, D]
//   k pool        the layer's key pages                       [P, Hkv, page_size, D]
//   v pool        the layer's value pages (Dv may differ)     [P, Hkv, page_size, Dv]
//   block_table   request b, logical page i -> physical page  int32 [B, max_pages]
//   context_lens  valid positions of request b (L included)   int32 [B]
//   slopes, sinks ALiBi slopes, sink logits (optional)        float32 [Hq]
//   k/v scales    quantized pools only: x = decode(code) * s    float32 [], [Hkv] or [P, Hkv, ps]
//   out, lse      attention output, its log-sum-exp           [B, Hq, L, Dv], float32 [B, Hq, L]
//
// Query row l of request b sits at absolute position p = ctx - L + l. Causal: keys
// j <= p; with window w also j > p - w. Query head h reads KV head h / (Hq / Hkv).
// The score pipeline past the dot product (soft-cap, ALiBi) runs in to_logits, the
// sink and the lse in finish_query_row: each row passes through them once, in the same
// functions, whatever the schedule. A quantized pool (pool type KV one of numerics.h's
// codes, the query type E a float) is decoded exactly as each vector is loaded and its
// scales applied once per key in attend_chunk: K's to the raw score, V's to the softmax
// weight (the denominator keeps the unscaled weight).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <new>
#include <vector>

#include "blocks.h"
#include "logits.h"
#include "numerics.h"

namespace pagecheck {

// Query lengths up to this use the decode schedule (chunk-parallel); longer ones the
// prefill schedule (query blocks). Both give the same bits per row.
constexpr int kDecodeMaxL = 8;

// A quantized pool's scales (contract/kv_format.py): one float (tensor), one per KV head
// (head), or one per slot [P, Hkv, ps] beside the pages (token), read at the physical slot.
struct Scales {
  enum Kind { kTensor, kHead, kToken };
  const float* data = nullptr;
  Kind kind = kTensor;
};

struct Problem {
  int B, Hq, Hkv, L, D, P, page_size, max_pages;
  int Dv;  // value head dim (the output's); D is the query's and the keys'
  // Logit mode (soft-cap, ALiBi or sinks): the scores are turned into the final logits
  // scale * q.k -> cap -> + bias (to_logits) before the max, so score_sign is +1 and
  // qk_scale log2(e). Without it the raw scores are kept, as below.
  bool logits;
  float scale;    // the signed scale (logit mode)
  float softcap;  // 0: none
  const float* slopes;  // [Hq] or null
  const float* sinks;   // [Hq] or null
  float lse_scale;      // natural-log units of one unit of m: |scale|, or 1 in logit mode
  float* lse;           // [B, Hq, L], written with the output
  // Scores are kept as sign(scale) * q.k, so the softmax max is a plain max whatever
  // the scale's sign; the max is subtracted before scaling by |scale| * log2(e), so the
  // exponent (s - m) * qk_scale keeps its accuracy at huge logits (no rounding of
  // s * scale on a coarse grid before the difference is taken).
  float score_sign;  // +1 or -1
  float qk_scale;    // |scale| * log2(e)
  bool causal;
  int window;  // 0: no window
  const int32_t* block_table;
  const int32_t* context_lens;
  bool quantized;             // the pools hold codes (kQuantized): resolve_slots, then the scales
  Scales k_scales, v_scales;  // read only for a quantized pool

  int group() const { return Hq / Hkv; }
  int context(int b) const { return context_lens[b]; }

  // Visible keys [lo, hi) of query row l of a request holding ctx positions.
  void span(int ctx, int l, int& lo, int& hi) const {
    if (!causal) {
      lo = 0;
      hi = ctx;
      return;
    }
    const int p = ctx - L + l;
    hi = p + 1;
    lo = (window > 0 && p - window + 1 > 0) ? p - window + 1 : 0;
  }

  // Elements of one KV head's slice of a key page ([page_size, D]) and of a value page
  // ([page_size, Dv]); a page holds Hkv of them.
  int64_t head_slice() const { return static_cast<int64_t>(page_size) * D; }
  int64_t value_slice() const { return static_cast<int64_t>(page_size) * Dv; }

  // Index of query row (b, h, l): its lse; times D its query, times Dv its output.
  int64_t row_index(int b, int h, int l) const { return (static_cast<int64_t>(b) * Hq + h) * L + l; }
  int64_t query_offset(int b, int h, int l) const { return row_index(b, h, l) * D; }
  int64_t output_offset(int b, int h, int l) const { return row_index(b, h, l) * Dv; }
};

// The scales of n keys (physical slots slot[0 .. n) of KV head g0, resolve_slots) for
// `heads` consecutive KV heads g0 + h, times `sign`: out[h * kChunk + k]. A token scale
// sits at the key's physical slot, the next head's page_size slots on.
inline void chunk_scales(const Problem& pr, const Scales& sc, const int64_t* slot, int n, int heads, float sign,
                         float* out) {
  if (sc.kind == Scales::kToken) {
    for (int h = 0; h < heads; ++h) {
      const float* head = sc.data + static_cast<int64_t>(h) * pr.page_size;
      for (int k = 0; k < n; ++k) out[h * kChunk + k] = head[slot[k]] * sign;
    }
    return;
  }
  const int64_t g0 = slot[0] / pr.page_size % pr.Hkv;
  for (int h = 0; h < heads; ++h) {
    const float v = sc.data[sc.kind == Scales::kHead ? g0 + h : 0] * sign;
    std::fill(out + h * kChunk, out + h * kChunk + n, v);
  }
}

// Logit mode: s[k] (the raw q.k of key j0 + k for a row of query head h at position p)
// becomes the final logit (logits.h: scale, soft-cap, ALiBi; the same bits whichever
// schedule asks). A NaN stays NaN.
inline void to_logits(const Problem& pr, int h, int p, int j0, float* s, int n) {
  logits_of(s, n, j0, p, pr.scale, pr.softcap, pr.slopes != nullptr ? pr.slopes + h : nullptr);
}

// The end of query row (b, h, l) from its merged state (m, l_sum, o): the sink, folded in
// here once per row (never per chunk or per thread: ROCm CK #12227 counted it twice),
// then the lse (natural log; -inf for a row that saw nothing), then the output.
template <class E>
inline void finish_query_row(const Problem& pr, int b, int h, int l, float m, float l_sum, float* o,
                             typename E::T* out) {
  if (pr.sinks != nullptr && l_sum != 0.f) add_sink(m, l_sum, o, pr.sinks[h], pr.Dv, pr.qk_scale);
  pr.lse[pr.row_index(b, h, l)] = l_sum == 0.f ? kNegInf : m * pr.lse_scale + std::log(l_sum);
  finish_row<E>(l_sum, o, out + pr.output_offset(b, h, l), pr.Dv);
}

// Whether request b can be computed without reading outside the pool. The Python
// layer rejects such input with a specific error before it gets here; this is the
// memory-safety net for a caller that bypasses it: such a request's output is NaN.
inline bool request_is_safe(const Problem& pr, int b) {
  const int ctx = pr.context(b);
  if (ctx < 0 || (ctx > 0 && ctx < pr.L)) return false;
  const int64_t pages = (static_cast<int64_t>(ctx) + pr.page_size - 1) / pr.page_size;
  if (pages > pr.max_pages) return false;
  const int32_t* row = pr.block_table + static_cast<int64_t>(b) * pr.max_pages;
  for (int64_t i = 0; i < pages; ++i) {
    if (row[i] < 0 || row[i] >= pr.P) return false;
  }
  return true;
}

// Element offsets of the rows of keys [j0, j1) of request b, KV head g, in a pool of
// rows of `width` elements (D for keys, Dv for values). One block-table lookup per
// page touched: a chunk that lies inside one page costs one. Offsets are 64-bit:
// page * page_stride passes 2^31 elements in large pools.
inline void resolve_rows(const Problem& pr, int b, int g, int j0, int j1, int64_t* off, int width) {
  const int ps = pr.page_size;
  const int32_t* row = pr.block_table + static_cast<int64_t>(b) * pr.max_pages;
  const int64_t slice = static_cast<int64_t>(ps) * width;  // one KV head's part of a page
  const int64_t page_stride = pr.Hkv * slice;
  const int64_t head = g * slice;
  int j = j0;
  while (j < j1) {
    const int logical = j / ps;
    const int64_t base = static_cast<int64_t>(row[logical]) * page_stride + head;
    const int end = static_cast<int>(std::min<int64_t>(j1, static_cast<int64_t>(logical + 1) * ps));
    for (int slot = j % ps; j < end; ++j, ++slot) off[j - j0] = base + static_cast<int64_t>(slot) * width;
  }
}

// Physical slots (page * Hkv + g) * page_size + slot of keys [j0, j1) of request b, KV
// head g: where a token scale of a quantized pool sits ([P, Hkv, ps]), found through the
// block table like the rows themselves (resolve_rows), one lookup per page.
inline void resolve_slots(const Problem& pr, int b, int g, int j0, int j1, int64_t* slot) {
  const int ps = pr.page_size;
  const int32_t* row = pr.block_table + static_cast<int64_t>(b) * pr.max_pages;
  for (int j = j0; j < j1;) {
    const int logical = j / ps;
    const int64_t first = (static_cast<int64_t>(row[logical]) * pr.Hkv + g) * ps;
    const int end = std::min(j1, (logical + 1) * ps);
    for (; j < end; ++j) slot[j - j0] = first + j % ps;
  }
}

// Widen query rows to float32 into q32 (rows x D). rows[r] = (h, l) of row r.
template <class E>
inline void load_query_rows(const Problem& pr, const typename E::T* q, int b, const int* heads,
                            const int* positions, int rows, float* q32) {
  for (int r = 0; r < rows; ++r) {
    widen<E>(q + pr.query_offset(b, heads[r], positions[r]), q32 + static_cast<int64_t>(r) * pr.D, pr.D);
  }
}

// Allocates on 64-byte (cache line) boundaries. A row that starts mid-line makes every
// 64-byte vector load touch two lines: 18% slower prefill here with rows 24 bytes off,
// where MLX's own buffers start (so scratch rows must not add to it).
template <class T>
struct LineAligned {
  using value_type = T;
  static constexpr std::align_val_t kAlign{64};
  LineAligned() = default;
  template <class U>
  LineAligned(const LineAligned<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), kAlign)); }
  void deallocate(T* p, size_t) { ::operator delete(p, kAlign); }
  template <class U>
  bool operator==(const LineAligned<U>&) const { return true; }
};
template <class T>
using AlignedVector = std::vector<T, LineAligned<T>>;

// Per-thread working memory, grown on demand and reused across calls.
struct Scratch {
  static constexpr int kScoreStride = kChunk + kBlock;  // a block may run past the chunk's keys

  AlignedVector<float> q32, scores, chunk_ml, chunk_o, acc_ml, acc_o, block, chunk_values;
  // A quantized pool's scales of a chunk's keys, per KV head of the item: K's (times the
  // score sign) and V's, [heads][kChunk].
  AlignedVector<float> key_scales, value_scales;
  // The tile path's operands (amx.cpp): query rows, packed K blocks and V slabs, bf16
  // weights, scores and stored accumulators.
  AlignedVector<uint16_t> tile_q, tile_qt, tile_k, tile_v, tile_p;
  AlignedVector<float> tile_s, tile_c;
  // Never written: the readable stand-ins for the missing keys of a block, per element size.
  AlignedVector<float> zeros;
  AlignedVector<uint16_t> zeros16;
  std::vector<int64_t> off, voff, slots;  // K and V row offsets of a chunk's keys; physical slots
  // Per row: query head, query row l, absolute position p, visible keys, clipped to a chunk.
  std::vector<int> heads, positions, pos, lo, hi, clo, chi;

  void reserve(int rows, const Problem& pr) {
    const size_t r = static_cast<size_t>(rows);
    const int widest = std::max(pr.D, pr.Dv);
    q32.resize(r * pr.D);
    scores.resize(r * kScoreStride);
    chunk_ml.resize(r * 2);
    chunk_o.resize(r * pr.Dv);
    acc_ml.resize(r * 2);
    acc_o.resize(r * pr.Dv);
    block.resize(static_cast<size_t>(kBlock) * widest);
    zeros.resize(widest);
    zeros16.resize(widest);
    off.resize(kChunk);
    voff.resize(kChunk);
    slots.resize(kChunk);
    for (auto* v : {&heads, &positions, &pos, &lo, &hi, &clo, &chi}) v->resize(r);
  }
  // The readable row of zeros for pool elements of type T (zero bytes: 0 in every code).
  template <class T>
  const T* zero_row() const {
    if constexpr (std::is_same_v<T, float>) return zeros.data();
    else if constexpr (sizeof(T) == 1) return reinterpret_cast<const T*>(zeros16.data());
    else return zeros16.data();
  }
  static Scratch& local() {
    thread_local Scratch s;
    return s;
  }
};

// K and V row offsets of keys [j0, j1) into s.off and, when Dv != D, s.voff (and a
// quantized pool's slots into s.slots); returns the V offsets (s.off itself when the two
// pools have rows of the same width).
inline const int64_t* resolve_kv_rows(const Problem& pr, int b, int g, int j0, int j1, Scratch& s) {
  resolve_rows(pr, b, g, j0, j1, s.off.data(), pr.D);
  if (pr.quantized) resolve_slots(pr, b, g, j0, j1, s.slots.data());
  if (pr.Dv == pr.D) return s.off.data();
  resolve_rows(pr, b, g, j0, j1, s.voff.data(), pr.Dv);
  return s.voff.data();
}

// A block's K or V rows as the blocked loops read them. Few rows per block (a decode
// head's GQA group): in place, a half type widened in registers as each vector is
// loaded, so no widening pass through memory. Many (prefill): widened once into
// float32 scratch, then reused by every row group; float32 rows are copied there
// only when they start mid cache line (read_in_place). Widening and copying are exact,
// so every way gives the same bits.
template <class E>
struct BlockRows {
  using T = typename E::T;
  const T* in_pool[kBlock];
  const float* widened[kBlock];
  bool use_widened = false;

  void point(const T* pool, const int64_t* off, int n, int D, bool widen_once, Scratch& s) {
    use_widened = widen_once && !read_in_place<E>(pool + off[0], D);
    if (use_widened) widen_rows<E>(pool, off, n, D, s.block.data(), s.zeros.data(), widened);
    else pool_rows<E>(pool, off, n, s.zero_row<T>(), in_pool);
  }
  // next: the pool rows of the block read after this one, asked for while this one
  // computes (ask_next), or null. A widened block is reused by many row groups, so its
  // loads are few and it asks for nothing.
  void scores(const float* const* q, int nr, int D, float* const* out, const T* const* next) const {
    if (use_widened) scores16_rows<F32>(q, nr, widened, D, out);
    else scores16_rows<E>(q, nr, in_pool, D, out, next);
  }
  // weigh_rows over the keys first .. first + n - 1 of the block.
  void weigh(int first, const float* const* p, int nr, int n, float* const* o, int D, const T* const* next) const {
    if (use_widened) weigh_rows<F32>(widened + first, p, nr, n, o, D);
    else weigh_rows<E>(in_pool + first, p, nr, n, o, D, next);
  }
};

// Open groups of rows keyed by their span [a, z) within one block of keys.
struct RowGroups {
  struct Group {
    int a, z, n;
    const float* p[kRowBlock];
    float* o[kRowBlock];
  };
  // At most one per distinct span: a block of 16 keys has at most this many, and a
  // chunk seen by a prefill query block at most one per position (prefill.cpp).
  static constexpr int kCapacity = kBlock * (kBlock + 1) / 2 + 1;
  Group list[kCapacity];
  int count = 0;

  Group& open(int a, int z) {
    for (int i = 0; i < count; ++i) {
      if (list[i].a == a && list[i].z == z) return list[i];
    }
    Group& g = list[count++];
    g.a = a;
    g.z = z;
    g.n = 0;
    return g;
  }
};

// Calls weigh(g) for the rows [r0, r1) that see keys of [w0, w1), gathered into groups
// of up to kRowBlock rows that see the same keys [a, z) of it (their spans clipped to
// [w0, w1)): g.p[i] points at row i's score of key a (scores start at key jlo), g.o[i] at
// its output. A group is weighed as soon as it is full, the partial ones at the end.
template <class Weigh>
inline void weigh_in_groups(int r0, int r1, int w0, int w1, const int* clo, const int* chi, int jlo,
                            const float* scores, float* o, int D, Weigh&& weigh) {
  RowGroups groups;
  const auto flush = [&](RowGroups::Group& g) {
    weigh(g);
    g.n = 0;
  };
  for (int r = r0; r < r1; ++r) {
    const int a = std::max(clo[r], w0), z = std::min(chi[r], w1);
    if (a >= z) continue;
    RowGroups::Group& g = groups.open(a, z);
    g.p[g.n] = scores + static_cast<int64_t>(r) * Scratch::kScoreStride + (a - jlo);
    g.o[g.n++] = o + static_cast<int64_t>(r) * D;
    if (g.n == kRowBlock) flush(g);
  }
  for (int i = 0; i < groups.count; ++i) {
    if (groups.list[i].n > 0) flush(groups.list[i]);
  }
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
// the same keys [a, z) of the chunk are weighed together, kRowBlock at a time, over all
// of those keys in one call, so their outputs stay in registers across the chunk instead
// of being loaded and stored again for every block of 16 keys (that traffic held the
// block-by-block loop at about half the multiply-add rate). The chunk's V rows are read
// in place (float32) or widened once into scratch. Every output element still adds
// p_j v_j for j ascending from a, one fused multiply-add each: the same bits as the
// block-by-block walk. Spans depend only on a row's position, so a prefill query block
// has at most one per position in a chunk, whatever the GQA group. Float32 rows that
// start mid cache line are copied too (read_in_place).
template <class E>
void weigh_by_group(const Problem& pr, const typename E::T* vpool, const int64_t* off, int jlo, int jhi,
                    int rows, int heads, const int* clo, const int* chi, Scratch& s, float* o) {
  const int D = pr.Dv, per_head = rows / heads, n = jhi - jlo;  // off: the V rows' offsets
  const float* values[kChunk];
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
    weigh_in_groups(h * per_head, (h + 1) * per_head, jlo, jhi, clo, chi, jlo, s.scores.data(), o, D,
                    [&](const RowGroups::Group& g) {
                      weigh_rows<F32>(values + (g.a - jlo), g.p, g.n, g.z - g.a, g.o, D, nullptr, /*fresh=*/true);
                    });
  }
}

// Attention of `rows` query rows over the keys of one chunk, for `heads` consecutive KV
// heads: rows [h * rows / heads, (h + 1) * rows / heads) read KV head h (counted from
// the head `off` points at). clo/chi: each row's visible keys clipped to the chunk
// (clo >= chi: none); [jlo, jhi): their union; off, voff: the K and V row offsets of
// keys jlo .. jhi-1 of the first head. In logit mode the scores become logits
// (to_logits, reading s.heads and s.pos). Writes each row's chunk state: ml[2r] = m,
// ml[2r+1] = l (0 when the row sees no key here), o[r*Dv ...]. K/V come in blocks of up
// to 16 keys (for_blocks) so a block is loaded (and widened) once for all rows of the
// GQA group, and each block asks for the next one while it computes (for_blocks_ahead).
// values_by_group: weigh the values group by group over the whole chunk instead
// (weigh_by_group; for callers with many rows per head whose K/V stay in cache).
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
  const bool widen_once = per_head > kRowBlock;  // see BlockRows
  const int64_t value_stride = pr.value_slice();
  BlockRows<E> block;
  for (int r = 0; r < rows; ++r) {
    ml[2 * r] = kNegInf;
    ml[2 * r + 1] = 0.f;
    // weigh_by_group starts each row that sees a key from zero itself; a row that sees
    // none keeps l == 0, so merge_state never reads its o.
    if (!values_by_group) std::fill(o + static_cast<int64_t>(r) * Dv, o + static_cast<int64_t>(r + 1) * Dv, 0.f);
  }
  if constexpr (kQuantized<E>) {
    // One scale per (head, key), looked up once here: K's with the score's sign folded in
    // (exact), so each score is multiplied once.
    s.key_scales.resize(static_cast<size_t>(heads) * kChunk);
    s.value_scales.resize(static_cast<size_t>(heads) * kChunk);
    chunk_scales(pr, pr.k_scales, s.slots.data(), jhi - jlo, heads, pr.score_sign, s.key_scales.data());
    chunk_scales(pr, pr.v_scales, s.slots.data(), jhi - jlo, heads, 1.f, s.value_scales.data());
  }
  const T* zero_row = s.zero_row<T>();
  for_blocks_ahead<E>(pr, kpool, off, jlo, jhi, heads, head_stride, zero_row,
                      [&](int h, int jb, int n, const T* const* next) {
    const T* kh = kpool + h * head_stride;
    block.point(kh, off + (jb - jlo), n, D, widen_once, s);
    // A float32 value pass that copies the chunk's V rows after the softmax (pool rows
    // that start mid cache line, as MLX's do) gets them from L2 instead of L3 when they
    // are asked for now: L 2048 prefill, 2 threads, 120.4 -> 117.9 ms. Measured and left
    // out: asking for rows read in place (2% slower) or for half-type rows (3% slower).
    if constexpr (std::is_same_v<E, F32>) {
      const T* head_values = vpool + h * value_stride;
      if (values_by_group && !read_in_place<E>(head_values + voff[0], Dv)) {
        ask_rows(head_values, voff + (jb - jlo), n, Dv);
      }
    }
    // The rows of this head that see a key of this block, kRowBlock at a time.
    const float* qs[kRowBlock];
    float* ss[kRowBlock];
    int nsel = 0;
    const auto score_selected = [&] {
      block.scores(qs, nsel, D, ss, next);
      next = nullptr;  // asked for by the first rows
      if constexpr (kQuantized<E>) {  // K's scale, once per score (the sign folded in)
        const float* ks = s.key_scales.data() + h * kChunk + (jb - jlo);
        for (int i = 0; i < nsel; ++i)
          for (int k = 0; k < n; ++k) ss[i][k] *= ks[k];
      } else if (pr.score_sign < 0.f) {  // a negative scale; times +1 would change no bit
        for (int i = 0; i < nsel; ++i)
          for (int k = 0; k < n; ++k) ss[i][k] *= pr.score_sign;  // exact
      }
      nsel = 0;
    };
    for (int r = h * per_head; r < (h + 1) * per_head; ++r) {
      if (clo[r] >= jb + n || chi[r] <= jb) continue;
      qs[nsel] = q32 + static_cast<int64_t>(r) * D;
      ss[nsel++] = s.scores.data() + r * stride + (jb - jlo);
      if (nsel == kRowBlock) score_selected();
    }
    if (nsel > 0) score_selected();  // the last rows that see this block, fewer than kRowBlock
  });
  // Softmax numerators and denominators, per row, over its visible keys only.
  for (int r = 0; r < rows; ++r) {
    if (clo[r] >= chi[r]) continue;
    float* sc = s.scores.data() + r * stride + (clo[r] - jlo);  // key clo[r] onwards
    const int n = chi[r] - clo[r];
    if (pr.logits) to_logits(pr, s.heads[r], s.pos[r], clo[r], sc, n);
    const float m = max_of(sc, n);
    exp2_shifted(sc, n, m, pr.qk_scale);
    ml[2 * r] = m;
    ml[2 * r + 1] = lane_sum(sc, clo[r], n);
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
  for_blocks_ahead<E>(pr, vpool, voff, jlo, jhi, heads, value_stride, zero_row,
                      [&](int h, int jb, int n, const T* const* next) {
    const T* vh = vpool + h * value_stride;
    block.point(vh, voff + (jb - jlo), n, Dv, widen_once, s);
    // Rows that see the same keys [a, z) of this block share their V loads: gather
    // them into groups of up to kRowBlock (a causal block has a few distinct spans;
    // the GQA heads of one position always share theirs).
    weigh_in_groups(h * per_head, (h + 1) * per_head, jb, jb + n, clo, chi, jlo, s.scores.data(), o, Dv,
                    [&](const RowGroups::Group& g) {
                      block.weigh(g.a - jb, g.p, g.n, g.z - g.a, g.o, Dv, next);
                      next = nullptr;
                    });
  });
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

// Calls X(E, KV) for every (query type, pool type) pair the kernel is built for: each
// query type with its own pools and with each quantized code (paged_attention.cpp's
// run_format dispatches to them). One list, so a new code is instantiated by both
// schedules at once.
#define PAGECHECK_FOR_EACH_POOL_TYPE(X) \
  X(F32, F32) X(F32, FP8E4M3) X(F32, FP8E5M2) X(F32, I8) \
  X(BF16, BF16) X(BF16, FP8E4M3) X(BF16, FP8E5M2) X(BF16, I8) \
  X(F16, F16) X(F16, FP8E4M3) X(F16, FP8E5M2) X(F16, I8)

// E: the query's and the output's type; KV: the pools' (E itself, or a quantized code).
template <class E, class KV>
void run_decode(const Problem& pr, const typename E::T* q, const typename KV::T* kpool,
                const typename KV::T* vpool, typename E::T* out, const std::vector<int>& live);

template <class E, class KV>
void run_prefill(const Problem& pr, const typename E::T* q, const typename KV::T* kpool,
                 const typename KV::T* vpool, typename E::T* out, const std::vector<int>& live);

}  // namespace pagecheck
