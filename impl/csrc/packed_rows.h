// The FMA path over a tile-packed pool (packed_layout.h): a chunk's K and V rows are
// unpacked into scratch first, then attend_chunk reads them as a row-layout pool whose
// one "page" per KV head is the chunk. The path of a packed pool without the tiles
// (no AMX, set_amx(false)): correct and bit-identical to the row layout (the same rows,
// and the FMA path's bits do not depend on where its blocks of keys start), not fast —
// the unpacking is a scalar pass over the chunk's K and V.
#pragma once

#include <algorithm>
#include <cstdint>

#include "kernel.h"
#include "packed_layout.h"

namespace pagecheck {

// What attend_chunk reads for keys [jlo, jhi) of `heads` KV heads: the pools and the row
// offsets resolve_kv_rows found, or for a packed pool the chunk's rows unpacked into
// scratch (key j of head h at h * kChunk * D + (j - c0) * D, c0 the chunk's first key;
// s.off rewritten to those offsets) with a problem of one page of kChunk per head.
template <class KV>
struct ChunkRows {
  Problem pr;
  const typename KV::T* k;
  const typename KV::T* v;
  const int64_t* off;
  const int64_t* voff;
};

template <class KV>
ChunkRows<KV> rows_of_chunk(const Problem& pr, const typename KV::T* kpool, const typename KV::T* vpool,
                            const int64_t* voff, int jlo, int jhi, int heads, Scratch& s) {
  if constexpr (std::is_same_v<KV, BF16>) {
    if (pr.packed) {
      const int D = pr.D, ps = pr.page_size, c0 = jlo / kChunk * kChunk;
      const int64_t slice = static_cast<int64_t>(kChunk) * D;
      s.unpacked_k.resize(heads * slice);
      s.unpacked_v.resize(heads * slice);
      for (int h = 0; h < heads; ++h) {
        for (int j = jlo; j < jhi; ++j) {
          const int slot = j % ps;
          // s.off holds the row layout's offsets: the slot's row sits slot * D into its slice.
          const int64_t base = h * pr.head_slice() + s.off[j - jlo] - static_cast<int64_t>(slot) * D;
          uint16_t* krow = s.unpacked_k.data() + h * slice + static_cast<int64_t>(j - c0) * D;
          uint16_t* vrow = s.unpacked_v.data() + h * slice + static_cast<int64_t>(j - c0) * D;
          for (int d = 0; d < D; ++d) {
            krow[d] = kpool[base + packed_key_index(slot, d, D)];
            vrow[d] = vpool[base + packed_value_index(slot, d, D)];
          }
        }
      }
      for (int j = jlo; j < jhi; ++j) s.off[j - jlo] = static_cast<int64_t>(j - c0) * D;
      ChunkRows<KV> rows{pr, s.unpacked_k.data(), s.unpacked_v.data(), s.off.data(), s.off.data()};
      rows.pr.page_size = kChunk;
      return rows;
    }
  }
  return {pr, kpool, vpool, s.off.data(), voff};
}

}  // namespace pagecheck
