// The AMX tile instructions as the tile path (amx.cpp) uses them: fixed tile registers,
// C[i][j] += A[i] B[j] over steps for up to 2 x 2 tiles (the 16 x 16 transpose that packs
// key blocks is transposed.h's transpose16). Only for builds with the tile path
// (PAGECHECK_AMX_BUILD).
#pragma once

#include <cstdint>

#if defined(__x86_64__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define PAGECHECK_AMX_BUILD 1
#include <immintrin.h>

#include "transposed.h"  // transpose16

namespace pagecheck {

// The tile instructions, by register number. GCC's _tile_loadd tells the compiler
// nothing about the memory it reads, so stores to a buffer could sink below the load
// of it; every one of these is a compiler memory barrier.
#define PC_TLOAD(t, p, stride) \
  asm volatile("tileloadd (%0,%1,1), %%tmm" #t ::"r"(p), "r"(static_cast<int64_t>(stride)) : "memory")
#define PC_TSTORE(t, p, stride) \
  asm volatile("tilestored %%tmm" #t ", (%0,%1,1)" ::"r"(p), "r"(static_cast<int64_t>(stride)) : "memory")
#define PC_TZERO(t) asm volatile("tilezero %%tmm" #t ::: "memory")
#define PC_TDP(c, a, b) asm volatile("tdpbf16ps %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::: "memory")

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

constexpr int64_t kTileRowBytes = 64;             // every tile row here: 16 floats or 32 bf16
constexpr int kTileElems = 16 * 64 / 2;           // bf16 elements of one full 1 KiB tile

// C[i][j] += A[i] B[j] over n steps (i < NA, j < NB): A[i] advances a_step elements and
// B[j] b_step elements a step. The C tiles stay in registers between calls.
template <int NA, int NB>
inline void tiles_zero() {
  PC_TZERO(0);
  if constexpr (NB == 2) PC_TZERO(1);
  if constexpr (NA == 2) PC_TZERO(2);
  if constexpr (NA == 2 && NB == 2) PC_TZERO(3);
}

template <int NA, int NB>
inline void tiles_steps(const uint16_t* a0, const uint16_t* a1, int64_t a_stride, int64_t a_step, const uint16_t* b0,
                        const uint16_t* b1, int64_t b_step, int n) {
  for (int i = 0; i < n; ++i) {
    PC_TLOAD(4, a0 + i * a_step, a_stride);
    if constexpr (NA == 2) PC_TLOAD(5, a1 + i * a_step, a_stride);
    PC_TLOAD(6, b0 + i * b_step, kTileRowBytes);
    if constexpr (NB == 2) PC_TLOAD(7, b1 + i * b_step, kTileRowBytes);
    PC_TDP(0, 4, 6);
    if constexpr (NB == 2) PC_TDP(1, 4, 7);
    if constexpr (NA == 2) PC_TDP(2, 5, 6);
    if constexpr (NA == 2 && NB == 2) PC_TDP(3, 5, 7);
  }
}

// c[i][j]: where C[i][j] goes (rows `stride` bytes apart).
template <int NA, int NB>
inline void tiles_store(float* const (&c)[2][2], int64_t stride) {
  PC_TSTORE(0, c[0][0], stride);
  if constexpr (NB == 2) PC_TSTORE(1, c[0][1], stride);
  if constexpr (NA == 2) PC_TSTORE(2, c[1][0], stride);
  if constexpr (NA == 2 && NB == 2) PC_TSTORE(3, c[1][1], stride);
}

// Calls f.template operator()<NA, NB>() for na, nb in {1, 2}.
template <class F>
inline void with_shape(int na, int nb, F&& f) {
  if (na == 2) {
    if (nb == 2) f.template operator()<2, 2>();
    else f.template operator()<2, 1>();
  } else {
    if (nb == 2) f.template operator()<1, 2>();
    else f.template operator()<1, 1>();
  }
}

}  // namespace pagecheck

#endif
