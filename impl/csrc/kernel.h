// What both schedules share past the problem description (problem.h): the walk through
// the block table, the score pipeline's row ends and the per-thread scratch (the per-chunk
// attention of a group of query rows is chunk.h's).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <new>
#include <vector>

#include "blocks.h"
#include "logits.h"
#include "numerics.h"
#include "problem.h"

namespace pagecheck {

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

}  // namespace pagecheck
