// The two loops of the bf16 decode on AMX tiles (impl/csrc/amx.cpp), alone, on one
// thread: how fast can they read a pool from DRAM? bench/notes/vllm-peer.md "bf16 decode on AMX" quotes
// this (issue 22 point 3); bench/test_amx_loops.py builds and runs it.
//
//   g++ -O2 -march=native -I impl/csrc bench/amx_loops.cpp -o amx_loops
//   ./amx_loops [pool MiB = 256]        (two at once: `./amx_loops & ./amx_loops; wait`)
//
// The pool is the contract's [P, Hkv = 8, page 128, D = 128] bf16, K and V, pages in a
// shuffled order, walked chunk by chunk (2 pages), slab by slab (32 keys), head by head,
// as the decode walks it. Each variant prints the rate it read K and / or V at:
//
//   variant           per (slab, head)
//   scores+gathers    the scores as key_scores takes them: 16 K rows straight from the
//                     pool as A tiles against packed queries, the S^T tile stored, then
//                     each of 4 query rows gathered out of it
//   scores            the same without reading the tile back (a floor, not a kernel)
//   scores+transpose  the tile read back by a 16 x 16 register transpose instead
//   scores-pipelined  the next slab's products issued before this slab's gathers
//   pack              V packed into pair-interleaved B tiles, as pack_values
//   scores+pack       scores+gathers and pack, as the decode runs them
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "amx_tiles.h"

#if !defined(PAGECHECK_AMX_BUILD)
int main() {
  std::puts("no tile path in this build (needs AVX512-BF16: -march=native on a CPU with it)");
  return 2;
}
#else
#include <sys/syscall.h>
#include <unistd.h>

using namespace pagecheck;

namespace {

constexpr int kHeads = 8, kPage = 128, kDim = 128, kRows = 4;  // kRows: a GQA group of 4
constexpr size_t kPageElems = size_t{kHeads} * kPage * kDim;

struct Pool {
  std::vector<int> table;
  uint16_t *k = nullptr, *v = nullptr;
  size_t bytes = 0;
  explicit Pool(size_t mib) {
    const int pages = static_cast<int>(std::max<size_t>(2, (mib << 20) / (kPageElems * 2)) / 2 * 2);
    bytes = pages * kPageElems * 2;
    k = static_cast<uint16_t*>(std::aligned_alloc(size_t{2} << 20, bytes));
    v = static_cast<uint16_t*>(std::aligned_alloc(size_t{2} << 20, bytes));
    madvise(k, bytes, MADV_HUGEPAGE);
    madvise(v, bytes, MADV_HUGEPAGE);
    for (size_t i = 0; i < bytes / 2; ++i) k[i] = v[i] = static_cast<uint16_t>(0x3F80 + (i & 7));  // 1.0 .. 1.05
    for (int p = 0; p < pages; ++p) table.push_back(p);
    std::shuffle(table.begin(), table.end(), std::mt19937(1));
  }
  ~Pool() {
    std::free(k);
    std::free(v);
  }
  // Slab u (32 keys) of KV head h in chunk c (pages 2c, 2c + 1).
  const uint16_t* slab(const uint16_t* pool, int c, int u, int h) const {
    return pool + table[2 * c + u / 4] * kPageElems + (size_t{static_cast<size_t>(h)} * kPage + (u % 4) * 32) * kDim;
  }
};

struct Loops {
  alignas(64) uint16_t qt[4 * kTileElems] = {};  // Q^T as B tiles, 4 d steps
  alignas(64) float tile[512] = {};               // two S^T tiles [16 keys][16 rows]
  alignas(64) float scores[kRows][32] = {};
  alignas(64) uint16_t packed[8 * kTileElems] = {};  // one V slab, 8 d tiles
  float sink = 0.f;

  // S^T for the slab's 2 blocks of 16 keys into tmm0 (block 0) and tmm2 (block 1), or
  // tmm1 / tmm3 (odd: the pipelined variant's second set).
  template <bool Odd>
  void products(const uint16_t* kb) {
    if constexpr (Odd) { PC_TZERO(1); PC_TZERO(3); } else { PC_TZERO(0); PC_TZERO(2); }
    for (int st = 0; st < 4; ++st) {
      PC_TLOAD(4, kb + 32 * st, kDim * 2);
      PC_TLOAD(5, kb + 16 * kDim + 32 * st, kDim * 2);
      PC_TLOAD(6, qt + st * kTileElems, kTileRowBytes);
      if constexpr (Odd) { PC_TDP(1, 4, 6); PC_TDP(3, 5, 6); } else { PC_TDP(0, 4, 6); PC_TDP(2, 5, 6); }
    }
  }
  template <bool Odd>
  void store() {
    if constexpr (Odd) { PC_TSTORE(1, tile, 64); PC_TSTORE(3, tile + 256, 64); }
    else { PC_TSTORE(0, tile, 64); PC_TSTORE(2, tile + 256, 64); }
  }
  void gather() {
    const __m512i column = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
    for (int b = 0; b < 2; ++b)
      for (int n = 0; n < kRows; ++n) _mm512_storeu_ps(scores[n] + 16 * b, _mm512_i32gather_ps(column, tile + 256 * b + n, 4));
  }
  void transpose() {
    for (int b = 0; b < 2; ++b) {
      __m512i r[16];
      for (int k = 0; k < 16; ++k) r[k] = _mm512_load_si512(tile + 256 * b + 16 * k);
      transpose16(r);
      for (int n = 0; n < kRows; ++n) _mm512_storeu_ps(scores[n] + 16 * b, _mm512_castsi512_ps(r[n]));
    }
  }
  void pack(const uint16_t* vb) {
    alignas(64) static constexpr uint16_t kLo[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                     8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    alignas(64) static constexpr uint16_t kHi[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                     24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
    const __m512i lo = _mm512_load_si512(kLo), hi = _mm512_load_si512(kHi);
    for (int i = 0; i < 16; ++i) {
      const uint16_t* a = vb + 2 * i * kDim;
      for (int x = 0; x < kDim / 32; ++x) {
        const __m512i va = _mm512_loadu_si512(a + 32 * x), vb2 = _mm512_loadu_si512(a + kDim + 32 * x);
        _mm512_storeu_si512(packed + (2 * x) * kTileElems + i * 32, _mm512_permutex2var_epi16(va, lo, vb2));
        _mm512_storeu_si512(packed + (2 * x + 1) * kTileElems + i * 32, _mm512_permutex2var_epi16(va, hi, vb2));
      }
    }
  }
};

double seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// GB/s of the best of 5 walks of the pool; `each(c, u, h, i)` runs one (slab, head), i
// counting them.
template <class Each>
double rate(const Pool& pool, size_t bytes_read, Each&& each) {
  double best = 1e30;
  for (int rep = 0; rep < 5; ++rep) {
    const double t0 = seconds();
    int64_t i = 0;
    for (int c = 0; c < static_cast<int>(pool.table.size()) / 2; ++c)
      for (int u = 0; u < 8; ++u)
        for (int h = 0; h < kHeads; ++h) each(c, u, h, i++);
    best = std::min(best, seconds() - t0);
  }
  return bytes_read / best / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) {  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    std::puts("Linux refused the tile state (no AMX here)");
    return 2;
  }
  const size_t mib = argc > 1 ? std::strtoul(argv[1], nullptr, 10) : 256;
  Pool pool(mib);
  Loops loops;
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = kTileRowBytes;
  }
  asm volatile("ldtilecfg %0" ::"m"(cfg) : "memory");
  const auto report = [&](const char* name, double gbs) { std::printf("%-18s %6.1f GB/s\n", name, gbs); };
  report("scores+gathers", rate(pool, pool.bytes, [&](int c, int u, int h, int64_t) {
    loops.products<false>(pool.slab(pool.k, c, u, h));
    loops.store<false>();
    loops.gather();
  }));
  report("scores", rate(pool, pool.bytes, [&](int c, int u, int h, int64_t) {
    loops.products<false>(pool.slab(pool.k, c, u, h));
    loops.store<false>();
  }));
  report("scores+transpose", rate(pool, pool.bytes, [&](int c, int u, int h, int64_t) {
    loops.products<false>(pool.slab(pool.k, c, u, h));
    loops.store<false>();
    loops.transpose();
  }));
  report("scores-pipelined", rate(pool, pool.bytes, [&](int c, int u, int h, int64_t i) {
    // this item's products into one tile set, then the previous item's read back
    if (i % 2 == 0) {
      loops.products<false>(pool.slab(pool.k, c, u, h));
      loops.store<true>();
    } else {
      loops.products<true>(pool.slab(pool.k, c, u, h));
      loops.store<false>();
    }
    loops.gather();
  }));
  report("pack", rate(pool, pool.bytes, [&](int c, int u, int h, int64_t) { loops.pack(pool.slab(pool.v, c, u, h)); }));
  report("scores+pack", rate(pool, 2 * pool.bytes, [&](int c, int u, int h, int64_t) {
    loops.products<false>(pool.slab(pool.k, c, u, h));
    loops.store<false>();
    loops.gather();
    loops.pack(pool.slab(pool.v, c, u, h));
  }));
  asm volatile("tilerelease" ::: "memory");
  loops.sink = loops.scores[0][0] + loops.packed[5];
  return loops.sink == 12345.f ? 3 : 0;  // keeps the stores
}
#endif
