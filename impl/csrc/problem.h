// The call as both schedules see it: the problem description (the pointers, shapes and
// score pipeline of one paged_attention call) and the two schedules' entry points, apart
// from kernel.h's row math, so the entry point (paged_attention.cpp, which parses MLX's
// headers) does not depend on the kernels' code.
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

#include <cstdint>
#include <vector>

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
