// The two loops of the FMA path (impl/csrc/score_loops.h, value_loops.h), alone, on one
// thread: scores16_rows and weigh_rows as attend_chunk runs them for one KV head of a decode
// (a GQA group of 4 query rows, D = 128), block by block over 16-key blocks of K/V rows,
// on float32 rows and on bfloat16 rows (widened in registers as they are loaded).
// bench/notes/vllm-peer.md "The FMA path's two loops" quotes it; bench/test_fma_loops.py builds and runs it
// with the kernels' own flags (CMakeLists.txt) and checks the score loops' code.
//
//   g++ -O3 -march=native -mprefer-vector-width=512 -ffp-contract=off -fno-math-errno
//       -std=c++20 -I impl/csrc bench/fma_loops.cpp -o fma_loops   (one line)
//   ./fma_loops [working set KiB ...]      (default 32 512 4096 65536)
//
// Rows start 24 bytes into a cache line, as MLX's buffers do; each block asks for the
// next block's lines as the kernel does (ask_next). Prints, per working set:
//
//   line                                    what
//   scores <type> <KiB> KiB <rate> GFMA/s      s[r][k] = dot(q_r, k_k), 4 rows x 16 keys a block
//   transposed <type> <KiB> KiB <rate> GFMA/s  the same scores from blocks transposed once
//                                              (scores_transposed<4, 1>)
//   transposed32 <type> <KiB> KiB <rate> GFMA/s  two transposed blocks at once (the
//                                              prefill's loop: scores_transposed<4, 2>)
//   weigh <type> <KiB> KiB <rate> GFMA/s       o_r += p_r[k] v_k, 4 rows x 16 keys a block,
//                                              asking for the next block (a decode's loop)
//   weigh_scratch <type> <KiB> KiB <rate> GFMA/s  the same without asks (a decode's
//                                              rows without asks; a prefill's partial groups)
//   weigh6_scratch <type> <KiB> KiB <rate> GFMA/s  6 rows x 16 keys a block without asks
//                                              (a prefill's value loop, kWeighRows rows:
//                                              its V rows sit in scratch)
//   (type: f32 or bf16, the rows' element type; KiB: of those rows; the transposed
//   blocks are float32, twice the KiB for bf16)
//   same bits <type> yes|no                    the transposed scores of every block, one
//                                              or two at once, equal scores16_rows' bits
//
// A rate counts 16-lane fused multiply-adds (a 4-row block of 16 keys is 512 of them in
// each loop, a 6-row one 768): a core's ceiling is pagecheck_kernels.fma_peak_gflops() / 32 per thread.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "blocks.h"
#include "transposed.h"

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
constexpr int kFmasPerRow = kBlock * kD / kLanes;  // 16-lane multiply-adds a row of a block, each loop
constexpr double kSeconds = 0.25;  // per measurement

// Block b's 16 rows of `pool`.
template <class T>
void rows_of(const T* pool, int b, const T** rows) {
  for (int k = 0; k < kBlock; ++k) rows[k] = pool + (static_cast<int64_t>(b) * kBlock + k) * kD;
}

// Runs `loop(rows, next)` on every block of `blocks` in `pool` (its 16 rows, and the
// next block's, which the loop asks for) until kSeconds have passed; returns GFMA/s
// (`fmas` a block: kFmasPerRow a row, 16 keys x D / 16 lanes).
template <class T, class Loop>
double rate(const T* pool, int blocks, Loop&& loop, int fmas = kFmasPerRow * kRows) {
  int64_t done = 0;
  const auto t0 = Clock::now();
  double t = 0;
  while (t < kSeconds) {
    for (int b = 0; b < blocks; ++b) {
      const T* rows[kBlock];
      const T* next[kBlock];
      rows_of(pool, b, rows);
      rows_of(pool, (b + 1) % blocks, next);
      loop(rows, next);
    }
    done += blocks;
    t = std::chrono::duration<double>(Clock::now() - t0).count();
  }
  return done * static_cast<double>(fmas) / t / 1e9;
}

// Both loops on `blocks` blocks of E rows, starting 24 bytes past a line boundary as in
// an MLX buffer; prints their lines (see the top).
template <class E>
void run(const char* type, int blocks, int D, std::vector<float>& q, std::vector<float>& scores,
         std::vector<float>& out) {
  using T = typename E::T;
  std::vector<T> buf(static_cast<size_t>(blocks) * kBlock * kD + 64);
  for (size_t i = 0; i < buf.size(); ++i) buf[i] = E::store(1e-3f * static_cast<float>(i % 97));
  const uintptr_t base = (reinterpret_cast<uintptr_t>(buf.data()) + 63) / 64 * 64 + 24;
  const T* pool = reinterpret_cast<const T*>(base);
  const float* qs[kRows];
  float* ss[kRows];
  float* os[kWeighRows];
  const float* ps[kWeighRows];
  for (int r = 0; r < kWeighRows; ++r) {
    os[r] = out.data() + r * kD;
    ps[r] = scores.data() + r * kBlock;
  }
  for (int r = 0; r < kRows; ++r) {
    qs[r] = q.data() + r * kD;
    ss[r] = scores.data() + r * kBlock;
  }
  const double s = rate(pool, blocks, [&](const T* const* rows, const T* const* next) {
    scores16_rows<E>(qs, kRows, rows, D, ss, next);
  });
  // Every block transposed once, as the prefill does before its row groups score it.
  std::vector<float> tbuf(static_cast<size_t>(blocks) * kBlock * kD + 16);
  float* tpool = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(tbuf.data()) + 63) / 64 * 64);
  const auto transposed_block = [&](const T* const* rows) {
    return tpool + (rows[0] - pool) / kD * kD;  // block b's rows start at row 16 b
  };
  bool same = true;
  for (int b = 0; b < blocks; ++b) {
    const T* rows[kBlock];
    rows_of(pool, b, rows);
    transpose_block<E>(rows, D, transposed_block(rows));
    float want[kRows][kBlock], got[kRows][kBlock];
    float* wp[kRows];
    float* gp[kRows];
    for (int r = 0; r < kRows; ++r) {
      wp[r] = want[r];
      gp[r] = got[r];
    }
    scores16_rows<E>(qs, kRows, rows, D, wp);
    scores_transposed_rows(qs, kRows, transposed_block(rows), nullptr, D, gp);
    same = same && std::memcmp(want, got, sizeof want) == 0;
  }
  const double t = rate(pool, blocks, [&](const T* const* rows, const T* const*) {
    scores_transposed_rows(qs, kRows, transposed_block(rows), nullptr, D, ss);
  });
  // Two transposed blocks at once, as the prefill scores them (scores_transposed<4, 2>): an
  // even block scores itself and its successor, an odd one nothing (a last even block
  // without a successor alone).
  std::vector<float> wide(kRows * 2 * kBlock);
  float* ws[kRows];
  for (int r = 0; r < kRows; ++r) ws[r] = wide.data() + r * 2 * kBlock;
  for (int b = 0; b + 1 < blocks; b += 2) {
    const T* rows[kBlock];
    const T* next[kBlock];
    rows_of(pool, b, rows);
    rows_of(pool, b + 1, next);
    float want[kRows][2 * kBlock], got[kRows][2 * kBlock];
    float* wp[kRows];
    float* gp[kRows];
    float* wq[kRows];
    for (int r = 0; r < kRows; ++r) {
      wp[r] = want[r];
      wq[r] = want[r] + kBlock;
      gp[r] = got[r];
    }
    scores16_rows<E>(qs, kRows, rows, D, wp);
    scores16_rows<E>(qs, kRows, next, D, wq);
    scores_transposed_rows(qs, kRows, transposed_block(rows), transposed_block(next), D, gp);
    same = same && std::memcmp(want, got, sizeof want) == 0;
  }
  const double t32 = rate(pool, blocks, [&](const T* const* rows, const T* const* next) {
    const int64_t b = (rows[0] - pool) / kD / kBlock;
    if (b % 2 == 1) return;
    if (b + 1 < blocks) scores_transposed_rows(qs, kRows, transposed_block(rows), transposed_block(next), D, ws);
    else scores_transposed_rows(qs, kRows, transposed_block(rows), nullptr, D, ws);
  });
  for (auto& p : scores) p = 1e-3f;
  const double w = rate(pool, blocks, [&](const T* const* rows, const T* const* next) {
    weigh_rows<E>(rows, ps, kRows, kBlock, os, D, next);
  });
  const double w0 = rate(pool, blocks, [&](const T* const* rows, const T* const*) {
    weigh_rows<E>(rows, ps, kRows, kBlock, os, D, nullptr);
  });
  const double w6 = rate(pool, blocks, [&](const T* const* rows, const T* const*) {
    weigh_rows<E>(rows, ps, kWeighRows, kBlock, os, D, nullptr);
  }, kFmasPerRow * kWeighRows);
  const int kib = static_cast<int>(int64_t{blocks} * kBlock * kD * static_cast<int>(sizeof(T)) / 1024);
  std::printf("scores %s %d KiB %.2f GFMA/s\n", type, kib, s);
  std::printf("transposed %s %d KiB %.2f GFMA/s\n", type, kib, t);
  std::printf("transposed32 %s %d KiB %.2f GFMA/s\n", type, kib, t32);
  std::printf("weigh %s %d KiB %.2f GFMA/s\n", type, kib, w);
  std::printf("weigh_scratch %s %d KiB %.2f GFMA/s\n", type, kib, w0);
  std::printf("weigh6_scratch %s %d KiB %.2f GFMA/s\n", type, kib, w6);
  std::printf("same bits %s %s\n", type, same ? "yes" : "no");
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
  std::vector<float> q(kRows * kD), scores(kWeighRows * kBlock), out(kWeighRows * kD, 0.f);
  // Query elements of both signs and many magnitudes, so that adding in other pairs
  // than the fold's would show in the "same bits" line.
  for (int i = 0; i < kRows * kD; ++i) q[i] = 0.01f * static_cast<float>((i * 37) % 23 - 11) * (1.f + 0.1f * (i % 7));
  for (const int kib : sizes_kib) {
    const int64_t bytes = int64_t{kib} * 1024;
    run<F32>("f32", std::max<int>(1, static_cast<int>(bytes / (kBlock * kD * 4))), D, q, scores, out);
    run<BF16>("bf16", std::max<int>(1, static_cast<int>(bytes / (kBlock * kD * 2))), D, q, scores, out);
  }
  if (out[5] == 42.f) std::puts("");  // keeps the outputs
  return 0;
}
#endif
