// The bfloat16 tile path (amx.h): a chunk of keys for the rows of a task, in passes
// over operands packed into scratch.
//
//   pass     tiles                                    operands
//   walk     decode: S^T[16 keys, rows] += K Q^T      K rows from the pool as A tiles (key_scores)
//            prefill: -                               K: 16-key blocks, [d pair][key] (pack_keys)
//                                                     V: 32-key slabs, [key pair][d] (pack_values)
//   score    prefill: S[rows, 16 keys] += Q K^T       up to 2 row tiles x 2 key blocks at once
//   softmax  -                                        per row, one pass after the max (row_weights)
//   weigh    O[rows, 16 d] += P[rows, 32 keys] V      up to 2 row tiles x 2 d tiles at once
//
// Tile registers: C tiles tmm0-3 (row tile i, column tile j in tmm 2i + j), A tiles
// tmm4-5 (row tiles), B tiles tmm6-7. Rows of a KV head are padded to whole row tiles
// of M rows (padded(h, n)); padding rows hold zeros and are never copied out. The walk
// reads the pool slab by slab, each slab's heads in turn: in address order. A tile-packed
// pool (packed_layout.h) needs no walk: its K blocks and V slabs are the B tiles already
// (place_units), and a decode scores them like a prefill. The walk is amx_walk.cpp's, the
// chunk's layout in scratch amx_chunk.h's; the passes after it, and switching the tiles
// on, are this file's.
#include "amx.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "amx_chunk.h"
#include "amx_tiles.h"

#if defined(PAGECHECK_AMX_BUILD)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace pagecheck {

#if defined(PAGECHECK_AMX_BUILD)

using namespace tiles;  // the chunk in scratch and the walk (amx_chunk.h)

namespace {

bool ask_linux_for_tiles() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool amx_bf16 = d & (1u << 22), amx_tile = d & (1u << 24);
  if (!amx_bf16 || !amx_tile) return false;
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
}

// The tile walk asks for its next rows only in calls whose K/V exceed this. In turns of
// processes on the Intel machine (bf16, 2 threads, medians), asking made B 4 S 8192 pages
// of 16 (128 MiB) 8.95-9.12 -> 7.6-8.0 ms, pages of 128 9.1-9.4 -> 7.5-8.2 and B 16 S 32768
// pages of 16 (2 GiB) 0.533-0.555 -> 0.553-0.589 of the read stream; B 16 S 1024 (64 MiB)
// 3.01-3.10 against 2.98-3.10; but B 1 S 8192 (32 MiB) 1.21-1.31 -> 1.50-1.56 ms (0.92x
// vLLM's op in a quick run), B 1 S 1024 0.105-0.112 -> 0.131-0.147, B 4 S 128 0.046-0.051 ->
// 0.060-0.065 and B 4 S 1024 (16 MiB) 0.49-0.54 -> 0.61-0.65: from cache the asks cost more
// than they hide, as for the FMA value pass (value_asks), up to a larger size here.
constexpr int64_t kTileAskKvBytes = int64_t{64} << 20;

std::atomic<int64_t>& walks_asking() {
  static std::atomic<int64_t> n{0};
  return n;
}

std::atomic<bool>& switched_on() {
  static std::atomic<bool> on{[] {
    const char* v = std::getenv("PAGECHECK_AMX");
    return amx_supported() && !(v != nullptr && std::strcmp(v, "0") == 0);
  }()};
  return on;
}

inline __mmask16 lanes_in(int first, int a, int z) {  // lanes k with a <= first + k < z
  const int lo = std::clamp(a - first, 0, 16), hi = std::clamp(z - first, 0, 16);
  return lo >= hi ? __mmask16(0) : __mmask16(((1u << hi) - 1u) & ~((1u << lo) - 1u));
}

// 2^x for x <= 0 (or NaN), for weights that are rounded to bfloat16 next: x = n + f
// with n = round(x), a degree-4 polynomial for 2^f (relative error 2.9e-6, far below
// the 2^-9 of that rounding; numerics.h's degree-6 one cost a third of the chunk time
// here), scaled by 2^n. 2^0 is exactly 1, x below the float range gives 0, NaN stays NaN.
inline __m512 exp2_weights(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(9.582852944731712e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5906426161527634e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4024099111557007e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931241750717163e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// o of the pair's rows that see a key, columns 16 dt .. 16 (dt + nb), from tmp (row i of
// row tile k at tmp + (16 k + i) * stride). Vector copies: a memcpy of this run-time
// size became `rep movsq`, 10% of an L 2048 prefill.
void copy_out(const Chunk& c, const TilePair& t, int dt, int nb, const float* tmp, int stride, const int* clo,
              const int* chi, float* o) {
  for (int k = 0; k < t.na; ++k) {
    for (int i = 0; i < c.M; ++i) {
      const int n = (t.rt + k) * c.M + i, r = t.h * c.N + n;
      if (n >= c.N || clo[r] >= chi[r]) continue;
      float* dst = o + static_cast<int64_t>(r) * c.pr.D + 16 * dt;
      const float* src = tmp + (16 * k + i) * stride;
      for (int v = 0; v < nb; ++v) _mm512_storeu_ps(dst + 16 * v, _mm512_loadu_ps(src + 16 * v));
    }
  }
}

// Scores of the pair's rows for key blocks blk and blk + 1 (if it is the pair's).
void score_blocks(Chunk& c, const TilePair& t, int blk) {
  const int nb = std::min(2, end_block(c, t) - blk);
  float* const dst[2][2] = {{c.score_row(t.p0) + blk * kKeyTile, c.score_row(t.p0) + (blk + nb - 1) * kKeyTile},
                            {c.score_row(t.p1) + blk * kKeyTile, c.score_row(t.p1) + (blk + nb - 1) * kKeyTile}};
  with_shape(t.na, nb, [&]<int NA, int NB>() {
    tiles_zero<NA, NB>();
    tiles_steps<NA, NB>(c.query_row(t.p0), c.query_row(t.p1), c.pr.D * 2, 32, c.kunit(t.h, blk),
                        c.kunit(t.h, blk + nb - 1), kTileElems, c.S);
    tiles_store<NA, NB>(dst, kScoreCols * 4);
  });
}

// One row's softmax over its keys [a, z) in one pass after the max: m = max s_j,
// p_j = bf16(exp2_weights((s_j - m) * qk_scale)), l = the sum of the p_j by VDPBF16PS
// against ones: lane k adds keys 2k and 2k + 1 of each 32-key slab (absolute positions;
// a key outside [a, z) adds +0, which changes no sum), slabs ascending, then
// fold_lanes. Writes the row's P over slabs [t0, t1) (zero outside [a, z)); (m, l) into ml.
void row_weights(const Chunk& c, float* row, int a, int z, int t0, int t1, uint16_t* w, float* ml) {
  const int ga = (a - c.c0) / 16, gz = (z - 1 - c.c0) / 16 + 1;
  if (c.pr.score_sign < 0.f) {
    for (int k = a - c.c0; k < z - c.c0; ++k) row[k] *= c.pr.score_sign;  // exact
  }
  // Masks only at the ends: the groups and slabs in between hold keys of [a, z) only.
  const __mmask16 first = lanes_in(c.c0 + 16 * ga, a, z), last = lanes_in(c.c0 + 16 * (gz - 1), a, z);
  __m512 top = _mm512_mask_loadu_ps(_mm512_set1_ps(kNegInf), first, row + 16 * ga);
  for (int g = ga + 1; g < gz - 1; ++g) top = _mm512_max_ps(_mm512_loadu_ps(row + 16 * g), top);
  if (gz - 1 > ga) top = _mm512_max_ps(_mm512_mask_loadu_ps(top, last, row + 16 * (gz - 1)), top);
  // (a NaN score is passed over by the max and poisons its p_j below)
  const float m = _mm512_reduce_max_ps(top);
  const __m512 mv = _mm512_set1_ps(m), scale = _mm512_set1_ps(c.pr.qk_scale);
  const __m512bh ones = reinterpret_cast<__m512bh>(_mm512_set1_epi16(0x3F80));
  __m512 sum = _mm512_setzero_ps();
  const auto slab = [&](int t, __mmask16 live0, __mmask16 live1) {
    const float* x = row + kSlab * t;
    const __m512 e0 = exp2_weights(_mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(live0, x), mv), scale));
    const __m512 e1 = exp2_weights(_mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(live1, x + 16), mv), scale));
    const __m512bh bf = _mm512_cvtne2ps_pbh(_mm512_maskz_mov_ps(live1, e1), _mm512_maskz_mov_ps(live0, e0));
    sum = _mm512_dpbf16_ps(sum, bf, ones);
    _mm512_storeu_si512(w + kSlab * t, reinterpret_cast<__m512i>(bf));
  };
  const int ta = (a - c.c0) / kSlab, tz = (z - 1 - c.c0) / kSlab + 1;
  for (int t = t0; t < ta; ++t) _mm512_storeu_si512(w + kSlab * t, _mm512_setzero_si512());
  for (int t = tz; t < t1; ++t) _mm512_storeu_si512(w + kSlab * t, _mm512_setzero_si512());
  const auto masked = [&](int t) { slab(t, lanes_in(c.c0 + kSlab * t, a, z), lanes_in(c.c0 + kSlab * t + 16, a, z)); };
  masked(ta);
  for (int t = ta + 1; t < tz - 1; ++t) slab(t, 0xFFFF, 0xFFFF);
  if (tz - 1 > ta) masked(tz - 1);
  ml[0] = m;
  ml[1] = fold_lanes16(sum);
}

// Row n of the pair's head: its softmax, or zero weights (a row that sees no key, a
// padding row) over the slabs the pair's weigh reads.
void softmax_row(Chunk& c, const TilePair& t, int n, const int* clo, const int* chi, float* ml) {
  const int r = t.h * c.N + n, p = c.padded(t.h, n), t0 = first_slab(c, t), t1 = end_slab(c, t);
  if (n < c.N) {
    ml[2 * r] = kNegInf;
    ml[2 * r + 1] = 0.f;
    if (clo[r] < chi[r]) {
      if (c.pr.logits) to_logits(c.pr, c.s.heads[r], c.s.pos[r], clo[r], c.score_row(p) + (clo[r] - c.c0), chi[r] - clo[r]);
      row_weights(c, c.score_row(p), clo[r], chi[r], t0, t1, c.weight_row(p), ml + 2 * r);
      return;
    }
  }
  if (t.a < t.z) std::memset(c.weight_row(p) + kSlab * t0, 0, (t1 - t0) * kSlab * sizeof(uint16_t));
}

// O = P V for the pair's rows and d tiles dt, dt + 1, slab by slab over the pair's
// slabs. A row's later slabs than its own last add zero weights to its o, which changes
// no bit: TDPBF16PS flushes subnormal results, so o is zero or normal and o + 0 is o
// (rows at every position of a prefill equal their decode, with values small enough
// for subnormal sums: test_amx).
void weigh_tiles(Chunk& c, const TilePair& t, int dt, const int* clo, const int* chi, float* o) {
  const int nb = std::min(2, c.DT - dt), u0 = first_slab(c, t);
  float* tmp = c.s.tile_c.data();  // [2 tiles x 16 rows][32 floats]
  float* const dst[2][2] = {{tmp, tmp + 16}, {tmp + 16 * 32, tmp + 16 * 32 + 16}};
  with_shape(t.na, nb, [&]<int NA, int NB>() {
    tiles_zero<NA, NB>();
    for (int u = u0; u < end_slab(c, t); ++u) {  // slab by slab: a packed pool's slabs lie in different pages
      tiles_steps<NA, NB>(c.weight_row(t.p0) + u * kSlab, c.weight_row(t.p1) + u * kSlab, kChunk * 2, 0,
                          c.vunit(t.h, u) + dt * kTileElems, c.vunit(t.h, u) + (dt + nb - 1) * kTileElems, 0, 1);
    }
    tiles_store<NA, NB>(dst, 32 * 4);
  });
  copy_out(c, t, dt, nb, tmp, 32, clo, chi, o);
}

// Scores, softmax and weighted values of every tile pair, phase after phase over all
// of them. Tile work and vector work do not overlap here: dealing the softmax rows out
// between the tile units of the neighbouring pairs made an L 2048 prefill slower (31.5
// -> 39.8 ms), and even running the three phases pair by pair did (33.3 ms).
// scored: the key walk took the scores already (key_scores).
void attend_pairs(Chunk& c, int heads, const int* clo, const int* chi, float* ml, float* o, bool scored) {
  thread_local std::vector<TilePair> pairs;
  pairs.clear();
  for (int h = 0; h < heads; ++h)
    for (int rt = 0; rt < c.RT; rt += 2) pairs.push_back(tile_pair(c, h, rt, clo, chi));
  for (const TilePair& t : pairs) {
    if (t.a >= t.z || scored) continue;
    for (int blk = first_block(c, t); blk < end_block(c, t); blk += 2) score_blocks(c, t, blk);
  }
  for (const TilePair& t : pairs) {
    for (int n = t.rt * c.M; n < (t.rt + t.na) * c.M; ++n) softmax_row(c, t, n, clo, chi, ml);
  }
  for (const TilePair& t : pairs) {
    if (t.a >= t.z) continue;
    for (int dt = 0; dt < c.DT; dt += 2) weigh_tiles(c, t, dt, clo, chi, o);
  }
}

}  // namespace

bool amx_supported() {
  static const bool ok = ask_linux_for_tiles();
  return ok;
}

bool amx_enabled() { return switched_on().load(std::memory_order_relaxed); }

int64_t tile_walks_asking() { return walks_asking().load(std::memory_order_relaxed); }

void set_amx(bool on) {
  if (on && !amx_supported())
    throw std::invalid_argument("AMX tiles are not available here (CPU without AMX-BF16, or Linux refused the tile state)");
  switched_on().store(on, std::memory_order_relaxed);
}

AmxTask::AmxTask(int m) : m_(m) {}

void AmxTask::reshape(int rows, int cols) {
  if (rows * 32 + cols == shape_) return;  // rows, cols <= 16
  shape_ = rows * 32 + cols;
  TileConfig cfg;
  for (int t = 0; t < 6; ++t) {  // C tiles tmm0-3 (cols floats), A tiles tmm4-5
    cfg.rows[t] = static_cast<uint8_t>(rows);
    cfg.colsb[t] = static_cast<uint16_t>(t < 4 ? cols * 4 : kTileRowBytes);
  }
  for (int t = 6; t < 8; ++t) {  // B tiles: 16 rows (d pairs or key pairs) of cols pairs
    cfg.rows[t] = 16;
    cfg.colsb[t] = static_cast<uint16_t>(cols * 4);
  }
  asm volatile("ldtilecfg %0" ::"m"(cfg) : "memory");
}

AmxTask::~AmxTask() { asm volatile("tilerelease" ::: "memory"); }

void amx_load_queries(const Problem& pr, const uint16_t* q, int b, const int* heads, const int* positions, int rows,
                      int nheads, const AmxTask& task, Scratch& s) {
  const int N = rows / nheads, M = task.rows(), RT = (N + M - 1) / M, D = pr.D;
  s.tile_q.assign(static_cast<size_t>(nheads) * RT * M * D, 0);
  for (int r = 0; r < rows; ++r) {
    const int p = (r / N) * RT * M + r % N;
    std::memcpy(s.tile_q.data() + static_cast<int64_t>(p) * D, q + pr.query_offset(b, heads[r], positions[r]),
                D * sizeof(uint16_t));
  }
  if (RT > 1 || pr.packed) return;
  // One row tile per head (decode) over a row-layout pool: also Q^T as B tiles for
  // key_scores: tile (h, st), row p, column n holds the d pair (32 st + 2 p, 32 st + 2 p
  // + 1) of row n.
  const int S = D / 32;
  s.tile_qt.assign(static_cast<size_t>(nheads) * S * kTileElems, 0);
  for (int r = 0; r < rows; ++r) {
    const uint16_t* row = s.tile_q.data() + static_cast<int64_t>((r / N) * M + r % N) * D;
    uint16_t* dst = s.tile_qt.data() + static_cast<int64_t>(r / N) * S * kTileElems + 2 * (r % N);
    for (int st = 0; st < S; ++st)
      for (int p = 0; p < 16; ++p) std::memcpy(dst + st * kTileElems + p * 32, row + 32 * st + 2 * p, 4);
  }
}

void amx_attend_chunk(const Problem& pr, const uint16_t* kpool, const uint16_t* vpool, const int64_t* off, int jlo,
                      int jhi, int rows, int heads, const int* clo, const int* chi, AmxTask& task, Scratch& s,
                      float* ml, float* o) {
  const int N = rows / heads, M = task.rows();
  Chunk c{pr, N, M, (N + M - 1) / M, pr.D / 32, pr.D / 16, (jlo / kChunk) * kChunk, jlo, jhi, s};
  const size_t padded_rows = static_cast<size_t>(heads) * c.RT * M;
  s.tile_k.resize(static_cast<size_t>(heads) * kBlocks * c.S * kTileElems);
  s.tile_v.resize(static_cast<size_t>(heads) * kSlabs * c.DT * kTileElems);
  s.tile_s.resize(padded_rows * kScoreCols);
  s.tile_p.resize(padded_rows * kChunk);
  s.tile_c.resize(2 * 16 * 32);
  s.tile_k_at.resize(static_cast<size_t>(heads) * kBlocks);
  s.tile_v_at.resize(static_cast<size_t>(heads) * kSlabs);
  if (pr.packed) {  // the operands are in the pool already: no walk, no packing
    place_units(c, kpool, vpool, off, heads);
    task.reshape(M);
    attend_pairs(c, heads, clo, chi, ml, o, /*scored=*/false);
    return;
  }
  for (int h = 0; h < heads; ++h) {
    for (int blk = 0; blk < kBlocks; ++blk) s.tile_k_at[h * kBlocks + blk] = c.ktile(h, blk);
    for (int u = 0; u < kSlabs; ++u) s.tile_v_at[h * kSlabs + u] = c.vtile(h, u);
  }
  // Slab by slab, each head's K and V of it: the pool is read in address order.
  const int u0 = (jlo - c.c0) / kSlab, u1 = (jhi - 1 - c.c0) / kSlab + 1;
  // One row tile per head (decode): the scores are taken on this walk, from the pool's K
  // rows as A tiles (key_scores), so K is read once and never packed; S^T tiles of 16 keys,
  // of 4 columns for up to 4 rows a head (key_scores' permutes).
  const bool keys_direct = c.RT == 1;
  task.reshape(keys_direct ? 16 : M, keys_direct ? key_tile_cols(c) : 16);
  // Asks only where the call's K/V exceed kTileAskKvBytes (why that size: there). A decode's
  // value loop asks for the next item's K rows too (Ahead::kpool).
  const auto walk = [&]<bool kAsks>() {
    for (int u = u0; u < u1; ++u) {
      for (int h = 0; h < heads; ++h) {
        Ahead ahead;
        if (h + 1 < heads) ahead = {h + 1, u};
        else if (u + 1 < u1) ahead = {0, u + 1};
        if (keys_direct) {
          ahead.kpool = kpool;
          key_scores(c, kpool, off, h, u, clo, chi);
        } else {
          for (int blk = 2 * u; blk < 2 * u + 2; ++blk) pack_keys<kAsks>(c, kpool, off, h, blk, ahead);
        }
        pack_values<kAsks>(c, vpool, off, h, u, ahead);
      }
    }
  };
  if (pr.kv_bytes > kTileAskKvBytes) {
    walk.template operator()<true>();
    walks_asking().fetch_add(1, std::memory_order_relaxed);  // one atomic add a chunk, for tests
  } else {
    walk.template operator()<false>();
  }
  task.reshape(M);
  attend_pairs(c, heads, clo, chi, ml, o, /*scored=*/keys_direct);
}

#else  // no tile path in this build

bool amx_supported() { return false; }
bool amx_enabled() { return false; }
int64_t tile_walks_asking() { return 0; }
void set_amx(bool on) {
  if (on) throw std::invalid_argument("AMX tiles are not available here (this build has no tile path)");
}
AmxTask::AmxTask(int m) : m_(m) {}
AmxTask::~AmxTask() = default;
void AmxTask::reshape(int rows, int cols) { shape_ = rows * 32 + cols; }
void amx_load_queries(const Problem&, const uint16_t*, int, const int*, const int*, int, int, const AmxTask&,
                      Scratch&) {
  throw std::logic_error("amx_load_queries: no tile path in this build");
}
void amx_attend_chunk(const Problem&, const uint16_t*, const uint16_t*, const int64_t*, int, int, int, int, const int*,
                      const int*, AmxTask&, Scratch&, float*, float*) {
  throw std::logic_error("amx_attend_chunk: no tile path in this build");
}

#endif

}  // namespace pagecheck
