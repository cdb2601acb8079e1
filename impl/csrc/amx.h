// The bfloat16 arithmetic on AMX tiles (Intel Advanced Matrix Extensions).
//
// On a CPU with AMX-BF16 (and a build with AVX512-BF16) a bfloat16 call multiplies on
// the tiles instead of with float32 fused multiply-adds: torch's bf16 SDPA runs above
// the float32 FMA peak here, which no FMA kernel can reach. It is a second canonical
// arithmetic, chosen per call for the whole call, so invariants 6-8 hold within it:
//
//   score   s_j = TDPBF16PS over d, 32 elements a step, steps ascending from 0
//   chunk   256-key chunks as numerics.h; m = max s_j; p_j = bf16(exp2_weights((s_j - m)
//           * qk_scale)) (degree-4 polynomial and vscalefps; the tiles take bf16 weights);
//           l = sum of the p_j by VDPBF16PS against ones (lane k: keys 2k, 2k + 1 of
//           each 32-key slab, slabs ascending), then fold_lanes;
//           o = TDPBF16PS over 32-key slabs at absolute positions, ascending
//   merge, finish: numerics.h
//
// TDPBF16PS matches no sequence of float32 operations (bench/notes/first-profile.md),
// so the tile bits differ from the FMA bits and a plain build cannot reproduce them;
// both are deterministic. A tile element (row, column) depends only on that row and
// column, and the same products in the same order give the same bits whichever operand
// is A: a prefill computes S = Q K^T, a decode S^T = K Q^T from the pool's rows, and
// they agree. A tile-packed pool (packed_layout.h) holds K and V already as the B tiles
// pack_keys / pack_values make: both schedules read them in place and score S = Q K^T
// (the same bits again: the same operands, in the same order). A row may run slabs
// after its own last one (zero weights): o + 0 = o, since the tiles flush subnormal
// results and o is zero or normal.
//
// Off: with $PAGECHECK_AMX=0 at load time, set_amx(false), on a CPU or kernel without
// AMX, for a head dim that is not a multiple of 32, or when Dv != Dk. Soft-cap, ALiBi,
// sinks and the lse run on the tiles too: to_logits on each row's scores before its
// softmax, the sink and the lse in finish_query_row (kernel.h), as on the FMA path.
#pragma once

#include <cstdint>

#include "kernel.h"
#include "kernel_info.h"  // amx_supported, amx_enabled, set_amx

namespace pagecheck {

// Whether this call's bfloat16 rows go through the tiles.
// The tile path packs V with the keys' head dim: a call whose value head dim differs
// (Dv != D) runs the FMA path instead (tested: test_amx's Dv case agrees with it).
inline bool amx_applies(const Problem& pr) { return pr.D % 32 == 0 && pr.Dv == pr.D && amx_enabled(); }

// Tile state of one task on the thread that runs it: row tiles of m query rows (m <=
// 16). amx_attend_chunk loads the configuration (reshape: A and C tiles of 16 rows for a
// decode's key walk, m rows otherwise; B tiles of 16 rows; C and B tiles of 4 columns for
// the key walk of a head of up to 4 rows, 16 otherwise) only as it changes.
// Released when the task ends, so an idle worker carries no tile state across context
// switches.
class AmxTask {
 public:
  explicit AmxTask(int m);
  ~AmxTask();
  AmxTask(const AmxTask&) = delete;
  AmxTask& operator=(const AmxTask&) = delete;
  int rows() const { return m_; }
  // A and C tiles of `rows` rows, C and B tiles of `cols` columns, from now on (no-op if
  // they already have them).
  void reshape(int rows, int cols = 16);

 private:
  int m_, shape_ = 0;
};

// Copies the task's query rows (bfloat16, as the A tiles read them): rows
// [h * rows / heads, (h + 1) * rows / heads) belong to KV head h, as in attend_chunk.
void amx_load_queries(const Problem& pr, const uint16_t* q, int b, const int* heads, const int* positions,
                      int rows, int nheads, const AmxTask& task, Scratch& s);

// attend_chunk (chunk.h) for bfloat16 on the tiles: the same arguments and the same
// chunk state (ml, o) per row, from the queries amx_load_queries copied.
void amx_attend_chunk(const Problem& pr, const uint16_t* kpool, const uint16_t* vpool, const int64_t* off, int jlo,
                      int jhi, int rows, int heads, const int* clo, const int* chi, AmxTask& task,
                      Scratch& s, float* ml, float* o);

}  // namespace pagecheck
