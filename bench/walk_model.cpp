// The bf16 tile decode's walk of the pool (impl/csrc/amx.cpp, amx_walk.cpp) as a model, on
// 2 threads: how fast its reads can go from DRAM with and without the work the decode does
// between them. bench/notes/decode-from-dram.md "The walk with the decode's work" quotes it
// (issue 22 point 5); bench/test_walk_model.py builds and runs it.
//
//   g++ -O2 -march=native -std=c++20 -pthread -I impl/csrc bench/walk_model.cpp -o walk_model
//   ./walk_model [MiB of K and of V = 1024] [rounds = 7]
//
// K and V pools of pages of 16 keys x 8 KV heads x D 128 bf16 (32 KiB, a head's slice 4 KiB),
// on 2 MiB pages, each page in a shuffled order. A thread walks its slabs (two pages of K and
// two of V), each slab's heads in turn, as the decode does. Medians over the rounds, in GB/s:
//
//   variant          per (slab, head)
//   linear           (the pools read front to back: the numpy stream's pattern)
//   loads            K and V slices read by vector loads
//   loads+asks       the same, each load asking for the next item's matching line (prefetcht1)
//   walk             K by tile loads (16 rows 256 bytes apart, 4 d steps), V by vector loads
//                    asking for the next item's K and V lines (pack_values)
//   walk+work        and the decode's work: 8 S^T products, the V slab packed into 512 KiB of
//                    scratch, after every 64 items a weigh (tile loads of the scratch and products)
//   walk+work-asks   the same without asks
//   walk+work+gather and each score row gathered out of a 16-column S^T tile (key_scores before
//                    its 4-column tiles)
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <thread>
#include <vector>

#include "amx_tiles.h"
#include "lanes.h"  // kPrefetchLocality: the kernels' asks

#if defined(PAGECHECK_AMX_BUILD)
using namespace pagecheck;

namespace {

constexpr size_t kPage = 32768, kSlice = 4096, kHeads = 8, kLine = 64, kThreads = 2;
constexpr size_t kScratchLines = (512 << 10) / kLine;  // a chunk's packed V slabs (8 heads x 8 slabs)

struct Pools {
  char *k, *v;
  size_t pages;
  std::vector<uint32_t> korder, vorder;
  explicit Pools(size_t mib) : pages((mib << 20) / kPage / 2 * 2), korder(pages), vorder(pages) {
    k = static_cast<char*>(std::aligned_alloc(size_t{2} << 20, pages * kPage));
    v = static_cast<char*>(std::aligned_alloc(size_t{2} << 20, pages * kPage));
    madvise(k, pages * kPage, MADV_HUGEPAGE);
    madvise(v, pages * kPage, MADV_HUGEPAGE);
    std::fill(k, k + pages * kPage, 1);
    std::fill(v, v + pages * kPage, 1);
    for (size_t i = 0; i < pages; ++i) korder[i] = vorder[i] = static_cast<uint32_t>(i);
    std::mt19937 g(1);
    std::shuffle(korder.begin(), korder.end(), g);
    std::shuffle(vorder.begin(), vorder.end(), g);
  }
  ~Pools() { std::free(k), std::free(v); }
  size_t bytes() const { return 2 * pages * kPage; }
  // Item (slab s, head h): K of its two pages, then V of its two pages.
  void item(size_t s, size_t h, const char* (&p)[4]) const {
    p[0] = k + korder[2 * s] * kPage + h * kSlice, p[1] = k + korder[2 * s + 1] * kPage + h * kSlice;
    p[2] = v + vorder[2 * s] * kPage + h * kSlice, p[3] = v + vorder[2 * s + 1] * kPage + h * kSlice;
  }
};

// Asks for line l of the next item's piece q, as the kernels do, where there is one to ask for
// (ahead: the next item's pieces, or none). Always inlined: GCC 12 judges a call whose one
// effect is a prefetch free of side effects and drops it, as it once did in the tile walk
// (impl/csrc/amx_chunk.h Ahead) and in this program's first version, where a lambda made the
// asks and no variant asked; bench/test_walk_model.py reads that the asks are in the code.
[[gnu::always_inline]] inline void ask(const char* const* ahead, int q, size_t l) {
  if (ahead != nullptr) __builtin_prefetch(ahead[q] + l, 0, kPrefetchLocality);
}

enum Variant { kLoads, kLoadsAsks, kWalk, kWork, kWorkNoAsks, kWorkGather, kVariants };
const char* const kNames[] = {"loads", "loads+asks", "walk", "walk+work", "walk+work-asks", "walk+work+gather"};

struct Thread {
  alignas(64) uint16_t qt[kTileElems] = {};
  alignas(64) float tile[512] = {}, scores[4][256] = {};
  std::vector<__m512i> scratch = std::vector<__m512i>(kScratchLines);
  __m512i sum = _mm512_setzero_si512();

  void walk(const Pools& pools, Variant var, size_t s0, size_t s1) {
    TileConfig cfg;
    for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = kTileRowBytes;
    asm volatile("ldtilecfg %0" ::"m"(cfg) : "memory");
    const bool asks = var != kLoads && var != kWorkNoAsks, work = var >= kWork;
    size_t at = 0;
    for (size_t s = s0; s < s1; ++s) {
      for (size_t h = 0; h < kHeads; ++h) {
        const char *p[4], *next[4] = {};
        pools.item(s, h, p);
        const bool more = h + 1 < kHeads || s + 1 < s1;
        if (more) pools.item(h + 1 < kHeads ? s : s + 1, (h + 1) % kHeads, next);
        const char* const* ahead = asks && more ? next : nullptr;
        if (var <= kLoadsAsks) {
          for (int q = 0; q < 4; ++q)
            for (size_t l = 0; l < kSlice; l += kLine) sum = _mm512_add_epi32(sum, _mm512_load_si512(p[q] + l)), ask(ahead, q, l);
          continue;
        }
        if (work) {
          PC_TZERO(0);
          PC_TZERO(2);
        }
        for (int st = 0; st < 4; ++st) {  // K: 2 x 16 keys, 32 d a step
          PC_TLOAD(4, p[0] + 64 * st, 256);
          PC_TLOAD(5, p[1] + 64 * st, 256);
          if (!work) continue;
          PC_TLOAD(6, qt, kTileRowBytes);
          PC_TDP(0, 4, 6);
          PC_TDP(2, 5, 6);
        }
        if (work) {
          PC_TSTORE(0, tile, 64);
          PC_TSTORE(2, tile + 256, 64);
        }
        if (var == kWorkGather) {
          const __m512i column = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
          for (int b = 0; b < 2; ++b)
            for (int n = 0; n < 4; ++n)
              _mm512_storeu_ps(scores[n] + 32 * (at / 16 % 8) + 16 * b, _mm512_i32gather_ps(column, tile + 256 * b + n, 4));
        }
        const __m512i pick = _mm512_set1_epi16(3);
        for (size_t l = 0; l < kSlice; l += 2 * kLine) {  // V: two rows' lines at a time, as pack_values
          for (int q = 2; q < 4; ++q) {
            const __m512i a = _mm512_load_si512(p[q] + l), b = _mm512_load_si512(p[q] + l + kLine);
            ask(ahead, q, l), ask(ahead, q, l + kLine), ask(ahead, q - 2, l), ask(ahead, q - 2, l + kLine);
            if (!work) {
              sum = _mm512_add_epi32(sum, _mm512_add_epi32(a, b));
              continue;
            }
            scratch[at % kScratchLines] = _mm512_permutex2var_epi16(a, pick, b);
            scratch[at % kScratchLines + 1] = _mm512_permutex2var_epi16(b, pick, a);
            if ((at += 2) % kScratchLines == 0) {  // a chunk's V slabs packed: weigh them
              for (size_t t = 0; t < kScratchLines; t += 16) {
                PC_TLOAD(6, &scratch[t], kTileRowBytes);
                PC_TLOAD(4, qt, kTileRowBytes);
                PC_TDP(1, 4, 6);
              }
            }
          }
        }
      }
    }
    asm volatile("tilerelease" ::: "memory");
  }
};

double seconds() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

template <class F>
double gbytes_per_s(size_t bytes, F&& per_thread) {
  const double t0 = seconds();
  std::vector<std::thread> threads;
  for (size_t t = 0; t < kThreads; ++t) threads.emplace_back(per_thread, t);
  for (std::thread& t : threads) t.join();
  return bytes / (seconds() - t0) / 1e9;
}

}  // namespace

#endif

int main(int argc, char** argv) {
#if !defined(PAGECHECK_AMX_BUILD)
  std::puts("no tile path in this build (needs AVX512-BF16: -march=native on a CPU with it)");
  return 2;
#else
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  if (syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) != 0) {
    std::puts("Linux gives this process no tile state (no AMX here)");
    return 2;
  }
  const Pools pools(argc > 1 ? std::strtoul(argv[1], nullptr, 10) : 1024);
  const int rounds = argc > 2 ? std::atoi(argv[2]) : 7;
  std::vector<Thread> threads(kThreads);
  std::vector<std::vector<double>> rates(kVariants + 1);
  const size_t slabs = pools.pages / 2;
  for (int r = 0; r < rounds; ++r) {
    rates[kVariants].push_back(gbytes_per_s(pools.bytes(), [&](size_t t) {
      __m512i sum = _mm512_setzero_si512();
      for (const char* base : {pools.k, pools.v})
        for (size_t l = pools.pages * kPage * t / kThreads; l < pools.pages * kPage * (t + 1) / kThreads; l += kLine)
          sum = _mm512_add_epi32(sum, _mm512_load_si512(base + l));
      threads[t].sum = _mm512_add_epi32(threads[t].sum, sum);
    }));
    for (int v = 0; v < kVariants; ++v)
      rates[v].push_back(gbytes_per_s(pools.bytes(), [&](size_t t) {
        threads[t].walk(pools, static_cast<Variant>(v), slabs * t / kThreads, slabs * (t + 1) / kThreads);
      }));
  }
  for (int v = 0; v <= kVariants; ++v) {
    std::sort(rates[v].begin(), rates[v].end());
    std::printf("%-17s %.1f GB/s\n", v == kVariants ? "linear" : kNames[v], rates[v][rates[v].size() / 2]);
  }
  int sink = 0;
  for (const Thread& t : threads) sink += _mm512_reduce_add_epi32(t.sum);
  return sink == 0x7fffffff ? 1 : 0;  // keeps the loads
#endif
}
