// The walk of the bfloat16 tile path (amx.h, amx_chunk.h): a chunk's K and V from the
// pool into tiles in scratch, slab by slab in address order, or, for a decode (one row
// tile per head), K straight from the pool as A tiles into the scores; a tile-packed
// pool's units are placed where they lie.
#include <algorithm>
#include <cstring>

#include "amx_chunk.h"

#if defined(PAGECHECK_AMX_BUILD)

namespace pagecheck::tiles {

// K block blk of head h as S B tiles: tile s, row p, column k holds the d pair
// (32 s + 2 p, 32 s + 2 p + 1) of key c0 + 16 blk + k: a 16 x 16 transpose of 32-bit pairs.
template <bool kAsks>
void pack_keys(Chunk& c, const uint16_t* kpool, const int64_t* off, int h, int blk, const Ahead& ahead) {
  const uint16_t* rows[kKeyTile];
  for (int k = 0; k < kKeyTile; ++k) rows[k] = key_row(c, kpool, off, h, c.c0 + blk * kKeyTile + k);
  uint16_t* dst = c.ktile(h, blk);
  for (int st = 0; st < c.S; ++st) {
    __m512i r[16];
    for (int k = 0; k < kKeyTile; ++k) {
      r[k] = _mm512_loadu_si512(rows[k] + 32 * st);
      if constexpr (kAsks) ahead.ask(c, kpool, off, (blk % 2) * kKeyTile + k, 32 * st);
    }
    transpose16(r);
    for (int p = 0; p < 16; ++p) _mm512_storeu_si512(dst + st * kTileElems + p * 32, r[p]);
  }
}

// V slab u of head h as DT B tiles: tile t, row i holds keys 2i and 2i + 1 of the slab
// interleaved element by element over d = 16 t .. 16 t + 15.
template <bool kAsks>
void pack_values(Chunk& c, const uint16_t* vpool, const int64_t* off, int h, int u, const Ahead& ahead) {
  alignas(64) static constexpr uint16_t kLo[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                   8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static constexpr uint16_t kHi[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                   24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i lo = _mm512_load_si512(kLo), hi = _mm512_load_si512(kHi);
  uint16_t* dst = c.vtile(h, u);
  for (int i = 0; i < kSlab / 2; ++i) {
    const int j = c.c0 + u * kSlab + 2 * i;
    const uint16_t* a = key_row(c, vpool, off, h, j);
    const uint16_t* b = key_row(c, vpool, off, h, j + 1);
    for (int x = 0; x < c.pr.D / 32; ++x) {
      const __m512i va = _mm512_loadu_si512(a + 32 * x), vb = _mm512_loadu_si512(b + 32 * x);
      if constexpr (kAsks) {
        ahead.ask(c, vpool, off, 2 * i, 32 * x);
        ahead.ask(c, vpool, off, 2 * i + 1, 32 * x);
        if (ahead.kpool != nullptr) {
          ahead.ask(c, ahead.kpool, off, 2 * i, 32 * x);
          ahead.ask(c, ahead.kpool, off, 2 * i + 1, 32 * x);
        }
      }
      _mm512_storeu_si512(dst + (2 * x) * kTileElems + i * 32, _mm512_permutex2var_epi16(va, lo, vb));
      _mm512_storeu_si512(dst + (2 * x + 1) * kTileElems + i * 32, _mm512_permutex2var_epi16(va, hi, vb));
    }
  }
}

// The K blocks and V slabs of [jlo, jhi) of a tile-packed pool (packed_layout.h), read
// where they lie: a block or slab never straddles a page (pages of a multiple of 32). A
// slab with keys outside [jlo, jhi) is copied instead, those keys' values zeroed: their
// weights are zero, but their slots may hold NaN (unwritten, freed: invariant 9), and
// 0 x NaN is NaN on the tiles. K needs no such copy: the softmax masks the scores of
// keys a row does not see, whatever they hold.
void place_units(Chunk& c, const uint16_t* kpool, const uint16_t* vpool, const int64_t* off, int heads) {
  const int D = c.pr.D, ps = c.pr.page_size;
  // Where the unit of `keys` keys holding key j (jlo <= j < jhi) of head h starts: the
  // slice's start (j's row offset in the row layout less the row's place in the slice)
  // plus the units before it.
  const auto unit = [&](const uint16_t* pool, int h, int j, int keys) {
    const int slot = j % ps;
    return pool + h * c.pr.head_slice() + off[j - c.jlo] - static_cast<int64_t>(slot) * D +
           static_cast<int64_t>(slot / keys) * keys * D;
  };
  const int b0 = (c.jlo - c.c0) / kKeyTile, b1 = (c.jhi - 1 - c.c0) / kKeyTile + 1;
  const int u0 = (c.jlo - c.c0) / kSlab, u1 = (c.jhi - 1 - c.c0) / kSlab + 1;
  for (int h = 0; h < heads; ++h) {
    for (int blk = b0; blk < b1; ++blk)
      c.s.tile_k_at[h * kBlocks + blk] = unit(kpool, h, std::max(c.jlo, c.c0 + blk * kKeyTile), kKeyTile);
    for (int u = u0; u < u1; ++u) {
      const int j0 = c.c0 + u * kSlab;
      const uint16_t* src = unit(vpool, h, std::max(c.jlo, j0), kSlab);
      if (j0 >= c.jlo && j0 + kSlab <= c.jhi) {
        c.s.tile_v_at[h * kSlabs + u] = src;
        continue;
      }
      // Row i of each tile holds keys j0 + 2i (even elements) and j0 + 2i + 1 (odd).
      uint16_t* dst = c.vtile(h, u);
      for (int i = 0; i < kSlab / 2; ++i) {
        const bool even = j0 + 2 * i >= c.jlo && j0 + 2 * i < c.jhi;
        const bool odd = j0 + 2 * i + 1 >= c.jlo && j0 + 2 * i + 1 < c.jhi;
        const __mmask32 keep = (even ? 0x55555555u : 0u) | (odd ? 0xAAAAAAAAu : 0u);
        for (int t = 0; t < c.DT; ++t) {
          const int64_t at = static_cast<int64_t>(t) * kTileElems + i * 32;
          _mm512_storeu_si512(dst + at, _mm512_maskz_loadu_epi16(keep, src + at));
        }
      }
      c.s.tile_v_at[h * kSlabs + u] = dst;
    }
  }
}

namespace {

// Score rows n < N of head h, keys of block blk, from the block's S^T tile of 4 columns
// stored as [16 keys][4 rows] at z: z[i] lane 4 k + n holds key 4 i + k of row n. For
// each pair of rows, one permute takes both rows' keys 0-7 (lanes 0-7, 8-15), one their
// keys 8-15, and two put each row's 16 keys together.
void narrow_rows(Chunk& c, int h, int blk, const float* z) {
  alignas(64) static constexpr int kPairs[2][16] = {{0, 4, 8, 12, 16, 20, 24, 28, 1, 5, 9, 13, 17, 21, 25, 29},
                                                    {2, 6, 10, 14, 18, 22, 26, 30, 3, 7, 11, 15, 19, 23, 27, 31}};
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  const __m512 z0 = _mm512_load_ps(z), z1 = _mm512_load_ps(z + 16), z2 = _mm512_load_ps(z + 32),
               z3 = _mm512_load_ps(z + 48);
  for (int n = 0; n < c.N; n += 2) {
    const __m512i pick = _mm512_load_si512(kPairs[n / 2]);
    const __m512 lo = _mm512_permutex2var_ps(z0, pick, z1), hi = _mm512_permutex2var_ps(z2, pick, z3);
    _mm512_storeu_ps(c.score_row(c.padded(h, n)) + blk * kKeyTile, _mm512_permutex2var_ps(lo, first, hi));
    if (n + 1 < c.N)  // row N of a head is the next head's first row: never written here
      _mm512_storeu_ps(c.score_row(c.padded(h, n + 1)) + blk * kKeyTile, _mm512_permutex2var_ps(lo, second, hi));
  }
}

// The same from a tile of 16 columns stored as [16 keys][16 rows] at z: a gather of 16
// elements a row.
void gathered_rows(Chunk& c, int h, int blk, const float* z) {
  const __m512i column = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
  for (int n = 0; n < c.N; ++n)
    _mm512_storeu_ps(c.score_row(c.padded(h, n)) + blk * kKeyTile, _mm512_i32gather_ps(column, z + n, 4));
}

}  // namespace

// The scores of head h's rows (one row tile: a decode) for the keys of slab u, as
// S^T = K Q^T: the A tiles are 16 K rows straight from the pool (or copied, where 16
// keys are not one run of rows), the B tile Q^T (amx_load_queries). Element (key, row)
// of S^T takes the same products in the same order as (row, key) of S = Q K^T, and the
// tiles give the same bits either way round (checked bit for bit: the decode and
// prefill schedules agree, test_amx). Needs A and C tiles of 16 rows, C and B tiles of
// key_tile_cols columns (task.reshape): the rows' scores
// come out of 4 columns by permutes (narrow_rows), where gathering them out of 16 took a
// vgatherdps a row and block. In turns of processes, against the gathers (bf16, pages of
// 16, G 4): B 4 S 1024 0.625-0.630 -> 0.496-0.591 ms, B 16 S 1024 2.73-2.78 -> 2.31-2.58 ms,
// B 16 S 32768 0.60-0.62 -> 0.63-0.67 of the read stream.
void key_scores(Chunk& c, const uint16_t* kpool, const int64_t* off, int h, int u, const int* clo, const int* chi) {
  const TilePair t = tile_pair(c, h, 0, clo, chi);  // the head's one row tile
  const int blk0 = std::max(2 * u, first_block(c, t)), blk1 = std::min(2 * u + 2, end_block(c, t));
  if (t.a >= t.z || blk0 >= blk1) return;
  const uint16_t* src[2];
  for (int blk = blk0; blk < blk1; ++blk) {
    // The block's rows in the pool are one run when every key of [jlo, jhi) in it sits
    // D elements after the previous one (a page of a multiple of 16 holds whole blocks);
    // rows of it outside [jlo, jhi) are then still inside that page: read, never used.
    const int j0 = std::max(c.jlo, c.c0 + blk * kKeyTile), j1 = std::min(c.jhi, c.c0 + (blk + 1) * kKeyTile);
    bool run = c.pr.page_size % kKeyTile == 0;
    for (int j = j0 + 1; run && j < j1; ++j) run = off[j - c.jlo] == off[j0 - c.jlo] + (j - j0) * c.pr.D;
    const uint16_t* first = kpool + h * c.pr.head_slice() + off[j0 - c.jlo] - (j0 - c.c0 - blk * kKeyTile) * c.pr.D;
    if (run) {
      src[blk - blk0] = first;
    } else {
      uint16_t* copy = c.ktile(h, blk);
      for (int k = 0; k < kKeyTile; ++k)
        std::memcpy(copy + k * c.pr.D, key_row(c, kpool, off, h, c.c0 + blk * kKeyTile + k), c.pr.D * sizeof(uint16_t));
      src[blk - blk0] = copy;
    }
  }
  const int cols = key_tile_cols(c), tile_floats = kKeyTile * cols;
  float* tmp = c.s.tile_c.data();  // [2 blocks][16 keys][4 or 16 rows]
  float* const dst[2][2] = {{tmp, tmp}, {tmp + tile_floats, tmp + tile_floats}};
  const uint16_t* qt = c.s.tile_qt.data() + static_cast<int64_t>(h) * c.S * kTileElems;
  with_shape(blk1 - blk0, 1, [&]<int NA, int NB>() {
    tiles_zero<NA, NB>();
    tiles_steps<NA, NB>(src[0], src[NA - 1], c.pr.D * 2, 32, qt, qt, kTileElems, c.S);
    tiles_store<NA, NB>(dst, cols * 4);
  });
  for (int blk = blk0; blk < blk1; ++blk) {
    if (cols == kNarrowRows) narrow_rows(c, h, blk, tmp + tile_floats * (blk - blk0));
    else gathered_rows(c, h, blk, tmp + tile_floats * (blk - blk0));
  }
}

template void pack_keys<true>(Chunk&, const uint16_t*, const int64_t*, int, int, const Ahead&);
template void pack_keys<false>(Chunk&, const uint16_t*, const int64_t*, int, int, const Ahead&);
template void pack_values<true>(Chunk&, const uint16_t*, const int64_t*, int, int, const Ahead&);
template void pack_values<false>(Chunk&, const uint16_t*, const int64_t*, int, int, const Ahead&);

}  // namespace pagecheck::tiles

#endif
