// The two loops of the float32 FMA path (impl/csrc/blocks.h), alone, on one thread:
// scores16_rows and weigh_rows as attend_chunk runs them for one KV head of a decode
// (a GQA group of 4 query rows, D = 128), block by block over 16-key blocks of K/V rows.
// README "The FMA path's two loops" quotes it; bench/test_fma_loops.py builds and runs it
// with the kernels' own flags (CMakeLists.txt) and checks the score loop's code.
//
//   g++ -O3 -march=native -mprefer-vector-width=512 -ffp-contract=off -fno-math-errno
//       -std=c++20 -I impl/csrc bench/fma_loops.cpp -o fma_loops   (one line)
//   ./fma_loops [working set KiB ...]      (default 32 512 4096 65536)
//
// Rows start 24 bytes into a cache line, as MLX's buffers do; each block asks for the
// next block's lines as the kernel does (ask_next). Prints, per working set:
//
//   line                               what
//   scores <KiB> KiB <rate> GFMA/s      s[r][k] = dot(q_r, k_k), 4 rows x 16 keys a block
//   weigh <KiB> KiB <rate> GFMA/s       o_r += p_r[k] v_k, 4 rows x 16 keys a block
//
// A rate counts 16-lane fused multiply-adds (a 4-row block of 16 keys is 512 of them in
// each loop): a core's ceiling is pagecheck_kernels.fma_peak_gflops() / 32 per thread.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "blocks.h"

#if !defined(__AVX512F__)
int main() {
  std::puts("no AVX-512 in this build: the kernels run their plain loops (needs -march=native on a CPU with it)");
  return 2;
}
#else
using namespace pagecheck;
using Clock = std::chrono::steady_clock;

namespace {

constexpr int kD = 128, kRows = 4;
constexpr double kSeconds = 0.25;  // per measurement

// Runs `loop(rows, next)` on every block of `blocks` in `pool` (its 16 rows, and the
// next block's, which the loop asks for) until kSeconds have passed; returns GFMA/s (512
// FMAs a block).
template <class Loop>
double rate(const float* pool, int blocks, Loop&& loop) {
  const auto rows_of = [&](int b, const float** rows) {
    for (int k = 0; k < kBlock; ++k) rows[k] = pool + (static_cast<int64_t>(b) * kBlock + k) * kD;
  };
  int64_t done = 0;
  const auto t0 = Clock::now();
  double t = 0;
  while (t < kSeconds) {
    for (int b = 0; b < blocks; ++b) {
      const float* rows[kBlock];
      const float* next[kBlock];
      rows_of(b, rows);
      rows_of((b + 1) % blocks, next);
      loop(rows, next);
    }
    done += blocks;
    t = std::chrono::duration<double>(Clock::now() - t0).count();
  }
  return done * 512.0 / t / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> sizes_kib;
  for (int i = 1; i < argc; ++i) sizes_kib.push_back(std::atoi(argv[i]));
  if (sizes_kib.empty()) sizes_kib = {32, 512, 4096, 65536};
  // The head dim as the kernel has it, known only at run time: a constant would let the
  // compiler specialize the loops into code the kernel does not run.
  volatile int head_dim = kD;
  const int D = head_dim;
  std::vector<float> q(kRows * kD, 0.01f), scores(kRows * kBlock), out(kRows * kD, 0.f);
  for (const int kib : sizes_kib) {
    const int blocks = std::max(1, static_cast<int>(int64_t{kib} * 1024 / (kBlock * kD * 4)));
    std::vector<float> buf(static_cast<size_t>(blocks) * kBlock * kD + 32);
    for (size_t i = 0; i < buf.size(); ++i) buf[i] = 1e-3f * static_cast<float>(i % 97);
    // rows from 24 bytes past a line boundary, as in an MLX buffer
    const uintptr_t base = (reinterpret_cast<uintptr_t>(buf.data()) + 63) / 64 * 64 + 24;
    const float* pool = reinterpret_cast<const float*>(base);
    const float* qs[kRows];
    float* ss[kRows];
    float* os[kRows];
    const float* ps[kRows];
    for (int r = 0; r < kRows; ++r) {
      qs[r] = q.data() + r * kD;
      ss[r] = scores.data() + r * kBlock;
      os[r] = out.data() + r * kD;
      ps[r] = scores.data() + r * kBlock;
    }
    const double s = rate(pool, blocks, [&](const float* const* rows, const float* const* next) {
      scores16_rows<F32>(qs, kRows, rows, D, ss, next);
    });
    for (auto& p : scores) p = 1e-3f;
    const double w = rate(pool, blocks, [&](const float* const* rows, const float* const* next) {
      weigh_rows<F32>(rows, ps, kRows, kBlock, os, D, next);
    });
    const int actual = static_cast<int>(int64_t{blocks} * kBlock * kD * 4 / 1024);
    std::printf("scores %d KiB %.2f GFMA/s\n", actual, s);
    std::printf("weigh %d KiB %.2f GFMA/s\n", actual, w);
  }
  if (out[5] == 42.f) std::puts("");  // keeps the outputs
  return 0;
}
#endif
