// The bfloat16 tile path's chunk in scratch (amx.h): where a chunk's operands live, the
// pool rows they come from, and the tile pairs the score and weigh passes take. Shared
// by the walk over the pool (amx_walk.cpp: K and V into tiles) and the passes after it
// (amx.cpp: scores, softmax, weighted values). Only for builds with the tile path.
#pragma once

#include <algorithm>
#include <cstdint>

#include "amx.h"
#include "amx_tiles.h"

#if defined(PAGECHECK_AMX_BUILD)

namespace pagecheck::tiles {

// The chunk's layout in scratch: K blocks of 16 keys (the columns of one S tile), V
// slabs of 32 keys (the K side of one P x V step), score rows indexed by key - c0.
constexpr int kKeyTile = 16;                    // keys per K block (columns of S)
constexpr int kSlab = 32;                       // keys per V slab (the K side of one P x V step)
constexpr int kBlocks = kChunk / kKeyTile;      // K blocks per chunk
constexpr int kSlabs = kChunk / kSlab;          // V slabs per chunk
constexpr int kScoreCols = kChunk + kKeyTile;   // a score row: key j at column j - c0
constexpr int kNarrowRows = 4;                  // a decode's heads of up to this many rows: S^T tiles of 4 columns

// Where one chunk's operands live in the task's scratch.
struct Chunk {
  const Problem& pr;
  int N, M, RT, S, DT;  // rows per KV head, tile rows, row tiles per head, d steps, d tiles
  int c0, jlo, jhi;
  Scratch& s;

  int padded(int h, int n) const { return h * RT * M + n; }
  uint16_t* ktile(int h, int blk) { return s.tile_k.data() + (static_cast<int64_t>(h) * kBlocks + blk) * S * kTileElems; }
  uint16_t* vtile(int h, int slab) { return s.tile_v.data() + (static_cast<int64_t>(h) * kSlabs + slab) * DT * kTileElems; }
  // Where the score and weigh passes read K block blk and V slab u of head h: the tiles
  // packed into scratch above, or a tile-packed pool's own (place_units).
  const uint16_t* kunit(int h, int blk) const { return s.tile_k_at[h * kBlocks + blk]; }
  const uint16_t* vunit(int h, int u) const { return s.tile_v_at[h * kSlabs + u]; }
  float* score_row(int p) { return s.tile_s.data() + static_cast<int64_t>(p) * kScoreCols; }
  uint16_t* weight_row(int p) { return s.tile_p.data() + static_cast<int64_t>(p) * kChunk; }
  const uint16_t* query_row(int p) const { return s.tile_q.data() + static_cast<int64_t>(p) * pr.D; }
};

// Columns of a decode's S^T tiles, one per row of a head: 4 for heads of up to kNarrowRows
// rows, else 16. The tile configuration (amx.cpp, task.reshape) and key_scores' read-back
// of the stored tiles (amx_walk.cpp) both take this one rule.
inline int key_tile_cols(const Chunk& c) { return c.N <= kNarrowRows ? kNarrowRows : 16; }

// The pool row of key j of KV head h, or a row of zeros outside [jlo, jhi).
inline const uint16_t* key_row(const Chunk& c, const uint16_t* pool, const int64_t* off, int h, int j) {
  if (j < c.jlo || j >= c.jhi) return c.s.zero_row<uint16_t>();
  return pool + h * c.pr.head_slice() + off[j - c.jlo];
}

// The item of the walk read after this one (head h, slab u), or none (h < 0): each
// load of this item asks for the matching line of that one, as ask_next (lanes.h)
// does. Always inlined: as a call, GCC 12 (-O1 and up) judged the member free of side
// effects (a prefetch is not one to it) and dropped every call, so the walk never asked
// for anything (bench/test_amx_loops.py::test_walk_asks_in_its_code reads the walk's
// code). Rows outside [jlo, jhi) are the zero row, asked for by nobody. Asking: a bf16
// decode from DRAM (B 16 S 32768 pages of 16, 2 threads, Intel with AMX, builds in turns
// of processes) 0.533-0.555 -> 0.553-0.589 of the read stream beside it.
//
// kpool: a decode's K pool, whose rows of the next item pack_values asks for beside V's.
// key_scores reads K by tile loads only, with no vector loop to spread asks over: asked
// there, all of a step's or block's lines at once, the asks held the line fill buffers
// while the tile work waited on them (B 16 S 32768 pages of 16 in turns of processes,
// before key_scores' 4-column tiles: 0.553-0.588 of the read stream asked in key_scores,
// 0.60-0.67 asked in pack_values, 0.556-0.599 asked between key_scores' tile steps; with
// those tiles, 0.63-0.66 against 0.58-0.61 with no asks for K at all).
struct Ahead {
  int h = -1, u = 0;
  const uint16_t* kpool = nullptr;
  [[gnu::always_inline]] void ask(const Chunk& c, const uint16_t* pool, const int64_t* off, int key, int d) const {
    const int j = c.c0 + u * kSlab + key;
    if (h >= 0 && j >= c.jlo && j < c.jhi)
      __builtin_prefetch(pool + h * c.pr.head_slice() + off[j - c.jlo] + d, 0, kPrefetchLocality);
  }
};

// Two row tiles of one KV head (or one: na), the unit of the score and weigh passes,
// and the keys [a, z) its rows see (a >= z: none).
struct TilePair {
  int h, rt, na;
  int a, z;
  int p0, p1;  // padded rows of the first row of each tile
};

inline TilePair tile_pair(const Chunk& c, int h, int rt, const int* clo, const int* chi) {
  TilePair t{h, rt, std::min(2, c.RT - rt), c.c0 + kChunk, c.c0, 0, 0};
  t.p0 = c.padded(h, rt * c.M);
  t.p1 = c.padded(h, (rt + t.na - 1) * c.M);
  for (int n = rt * c.M; n < std::min(c.N, (rt + t.na) * c.M); ++n) {
    const int r = h * c.N + n;
    if (clo[r] >= chi[r]) continue;
    t.a = std::min(t.a, clo[r]);
    t.z = std::max(t.z, chi[r]);
  }
  return t;
}

// The pair's key blocks [b0, b1) and slabs [t0, t1).
inline int first_block(const Chunk& c, const TilePair& t) { return (t.a - c.c0) / kKeyTile; }
inline int end_block(const Chunk& c, const TilePair& t) { return (t.z - 1 - c.c0) / kKeyTile + 1; }
inline int first_slab(const Chunk& c, const TilePair& t) { return (t.a - c.c0) / kSlab; }
inline int end_slab(const Chunk& c, const TilePair& t) { return (t.z - 1 - c.c0) / kSlab + 1; }

// The walk (amx_walk.cpp): K and V of [jlo, jhi) from the pool into the chunk's tiles,
// or, for a decode, K straight from the pool into the scores; with kAsks, the packing
// loops ask for the walk's next item (Ahead), and without, they hold no trace of the asks.
template <bool kAsks>
void pack_keys(Chunk& c, const uint16_t* kpool, const int64_t* off, int h, int blk, const Ahead& ahead);
template <bool kAsks>
void pack_values(Chunk& c, const uint16_t* vpool, const int64_t* off, int h, int u, const Ahead& ahead);
void place_units(Chunk& c, const uint16_t* kpool, const uint16_t* vpool, const int64_t* off, int heads);
void key_scores(Chunk& c, const uint16_t* kpool, const int64_t* off, int h, int u, const int* clo, const int* chi);

}  // namespace pagecheck::tiles

#endif
