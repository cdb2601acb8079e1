// What both schedules share: the problem description, the walk through the block
// table and the per-thread scratch (the per-chunk attention of a group of query rows
// is chunk.h's).
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
  // The pools' slices are tile-packed (packed_layout.h; bfloat16 only): the tile path
  // reads its operands from them, the FMA path unpacks each chunk's rows (unpack_chunk).
  bool packed;
  int64_t kv_bytes;  // K and V bytes the call's requests hold (value_span)

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

// A line-aligned array whose elements start unset, for buffers that are written before
// they are read: an AlignedVector value-initializes, a memset of its whole size (a
// decode's chunk states, every call).
template <class T>
class UnsetArray {
 public:
  explicit UnsetArray(size_t n) : n_(n), p_(n > 0 ? LineAligned<T>().allocate(n) : nullptr) {}
  ~UnsetArray() {
    if (p_ != nullptr) LineAligned<T>().deallocate(p_, n_);
  }
  UnsetArray(const UnsetArray&) = delete;
  UnsetArray& operator=(const UnsetArray&) = delete;
  T* data() const { return p_; }
  T& operator[](size_t i) const { return p_[i]; }

 private:
  size_t n_;
  T* p_;
};

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
  // Where the tile path's K units and V units of a chunk are: in tile_k / tile_v, or in a
  // tile-packed pool itself ([heads][blocks], [heads][slabs]).
  std::vector<const uint16_t*> tile_k_at, tile_v_at;
  // A tile-packed pool's chunk unpacked into rows for the FMA path (packed_rows.h).
  AlignedVector<uint16_t> unpacked_k, unpacked_v;
  // The query rows as bfloat16 in pair order (pair_dots.h), and whether each row may use them.
  AlignedVector<uint16_t> q_pairs;
  std::vector<uint8_t> q_pairs_ok;
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
    block.resize(static_cast<size_t>(2 * kBlock) * widest);  // two transposed K blocks (score_transposed)
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
