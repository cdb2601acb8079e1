// The tile-packed page layout: an opt-in order of a bfloat16 pool's pages in which the
// AMX tiles load K and V straight from the pool (issue 22 point 3; README, "bf16 decode
// on AMX"). The pages keep the contract's shape [P, Hkv, page_size, D]; only the order
// of the page_size x D elements inside each KV head's slice changes, so page ids, slots,
// block tables and page copies are as in the row layout. contract/page_layout.py states
// the same order in NumPy (the converter the oracles check through).
//
//   pool  unit (one run of tiles)   tile (1 KiB) of it   tile row            element of the row
//   K     16 keys: slot / 16        d step: d / 32       d pair: d % 32 / 2  2 (slot % 16) + d % 2
//   V     32 keys: slot / 32        d tile: d / 16       key pair: slot % 32 / 2   2 (d % 16) + slot % 2
//
// A K unit is the B operand of S = Q K^T for 16 keys (one tile per 32 d), a V unit the B
// operand of O = P V for 32 keys (one tile per 16 d): the operands the row layout's tile
// path packs into scratch on every call (amx.cpp pack_keys, pack_values).
#pragma once

#include <cstdint>

namespace pagecheck {

// How a pool's page slices are ordered: the write path takes one per pool (K and V differ).
enum PageOrder : int { kRowOrder = 0, kPackedKeyOrder = 1, kPackedValueOrder = 2 };

constexpr int kPackedKeyUnit = 16;    // keys per K unit
constexpr int kPackedValueUnit = 32;  // keys per V unit

// Whether a slice [page_size, D] can be packed: whole units and whole tiles.
inline bool packed_fits(int64_t page_size, int64_t D) { return page_size % kPackedValueUnit == 0 && D % 32 == 0; }

// Element index of (slot, d) inside one KV head's packed slice.
inline int64_t packed_key_index(int64_t slot, int64_t d, int64_t D) {
  return ((slot / kPackedKeyUnit * (D / 32) + d / 32) * 16 + d % 32 / 2) * 32 + 2 * (slot % kPackedKeyUnit) + d % 2;
}
inline int64_t packed_value_index(int64_t slot, int64_t d, int64_t D) {
  return ((slot / kPackedValueUnit * (D / 16) + d / 16) * 16 + slot % kPackedValueUnit / 2) * 32 + 2 * (d % 16) +
         slot % 2;
}
inline int64_t packed_index(PageOrder order, int64_t slot, int64_t d, int64_t D) {
  return order == kPackedKeyOrder ? packed_key_index(slot, d, D) : packed_value_index(slot, d, D);
}

}  // namespace pagecheck
