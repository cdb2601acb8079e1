// Thread-safety driver of the kernels, for ThreadSanitizer (python -m sanitize tsan).
//
// Built only with -DPAGECHECK_BUILD_TESTS=ON (registered with ctest as `thread_driver`).
// It goes through the same entry points as the Python binding (pagecheck::paged_attention,
// write_slots, mx::eval) with no Python in the process, so every report TSan makes is about
// our code or MLX's, never an uninstrumented interpreter's. Checks, each a failure on its
// own (exit status 1):
//
//   1. thread invariance: decode (L = 1, 4) and prefill (L = 40) shapes, f32 / bf16 / f16,
//      causal, windowed and unmasked, D a multiple of 16 or not, quantized pages (e5m2 with
//      token scales, int8 with head scales) too, run with 1 worker and with
//      2, 3, 4 and 8: every output byte equals the 1-worker run (REFERENCE.md invariant 7),
//      and a live request's output is finite (the pool's unread slots hold NaN).
//   2. two MLX CPU streams: two kernels evaluated at once on two stream threads share
//      the one worker pool; both give the 1-worker bytes.
//   3. concurrent callers of parallel_for (and a resize racing them): every item of every
//      loop runs exactly once.
//   4. the write path: write_slots into a donated pool, then the kernel reads it back.
//   5. the eager entry (paged_attention_now) from two threads at once beside a lazy call on
//      a stream thread: every output equals the 1-worker bytes.
//   6. the pool's waits: with the workers held a loop runs in its caller alone; items
//      workers hold past the caller's spin are waited for; 2^32 items are refused.
//
// Usage: thread_driver [rounds]   (default 1; each round repeats checks 1-3, 5 and 6)
#include <algorithm>
#include <chrono>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "mlx/mlx.h"
#include "paged_attention.h"
#include "pool_update.h"
#include "thread_pool.h"

namespace mx = mlx::core;

namespace {

int g_failures = 0;

void fail(const std::string& what) {
  std::fprintf(stderr, "FAIL: %s\n", what.c_str());
  ++g_failures;
}

struct Shape {
  const char* name;
  std::vector<int> context_lens;
  int L, Hq, Hkv, D, page_size;
  bool causal;
  int window;  // 0: none
  mx::Dtype dtype;
  int kv_code = pagecheck::kKvQueryDtype;  // quantized pages: e5m2 (token scales) or int8 (head scales)
};

// One paged batch: random page ids (a permutation with free pages in between), NaN in
// every slot no request may read, -1 past each row's pages.
struct Batch {
  mx::array q, kp, vp, table, lens;
  std::optional<mx::array> k_scale = std::nullopt, v_scale = std::nullopt;
};

// Float pages [P, Hkv, ps, D] as the codes of kv_code: e5m2 by truncating the float16
// (any code is valid input; NaN stays a NaN code), int8 as round(16 x) with NaN -> -128.
mx::array to_codes(const mx::array& pages, int kv_code) {
  if (kv_code == pagecheck::kKvFp8E5M2) {
    const mx::array bits = mx::view(mx::astype(pages, mx::float16), mx::uint16);
    return mx::astype(mx::right_shift(bits, mx::array(8, mx::uint16)), mx::uint8);
  }
  const mx::array scaled = mx::clip(mx::round(mx::multiply(pages, mx::array(16.f))), mx::array(-127.f),
                                    mx::array(127.f));
  return mx::astype(mx::where(mx::isnan(pages), mx::array(-128.f), scaled), mx::int8);
}

Batch make_batch(const Shape& s, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  const int B = static_cast<int>(s.context_lens.size()), ps = s.page_size;
  std::vector<int> need(B);
  int total = 0, max_pages = 1;
  for (int b = 0; b < B; ++b) {
    need[b] = (s.context_lens[b] + ps - 1) / ps;
    total += need[b];
    max_pages = std::max(max_pages, need[b]);
  }
  const int P = total + 3;
  std::vector<int32_t> order(P);
  for (int i = 0; i < P; ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), rng);
  std::vector<int32_t> table(static_cast<size_t>(B) * max_pages, -1);
  for (int b = 0, used = 0; b < B; ++b) {
    for (int i = 0; i < need[b]; ++i) table[static_cast<size_t>(b) * max_pages + i] = order[used++];
  }
  const size_t page = static_cast<size_t>(s.Hkv) * ps * s.D;
  std::vector<float> kp(P * page, NAN), vp(P * page, NAN);
  for (int b = 0; b < B; ++b) {
    for (int j = 0; j < s.context_lens[b]; ++j) {
      const size_t p = static_cast<size_t>(table[static_cast<size_t>(b) * max_pages + j / ps]);
      for (int g = 0; g < s.Hkv; ++g) {
        const size_t row = p * page + (static_cast<size_t>(g) * ps + j % ps) * s.D;
        for (int d = 0; d < s.D; ++d) {
          kp[row + d] = normal(rng);
          vp[row + d] = normal(rng);
        }
      }
    }
  }
  std::vector<float> q(static_cast<size_t>(B) * s.Hq * s.L * s.D);
  for (auto& x : q) x = normal(rng);
  const mx::Shape pool_shape{P, s.Hkv, ps, s.D};
  Batch out{mx::astype(mx::array(q.begin(), {B, s.Hq, s.L, s.D}), s.dtype),
            mx::astype(mx::array(kp.begin(), pool_shape), s.dtype),
            mx::astype(mx::array(vp.begin(), pool_shape), s.dtype),
            mx::array(table.begin(), {B, max_pages}),
            mx::array(s.context_lens.begin(), {B}, mx::int32)};
  if (s.kv_code != pagecheck::kKvQueryDtype) {
    out.kp = to_codes(out.kp, s.kv_code);
    out.vp = to_codes(out.vp, s.kv_code);
    if (s.kv_code == pagecheck::kKvFp8E5M2) {  // token scales
      out.k_scale = mx::full({P, s.Hkv, ps}, 0.5f);
      out.v_scale = mx::full({P, s.Hkv, ps}, 2.f);
    } else {
      out.k_scale = mx::array({1.f / 16, 1.f / 32}, {s.Hkv});
      out.v_scale = mx::array(1.f / 16);
    }
    mx::eval(out.kp, out.vp, *out.k_scale, *out.v_scale);
  }
  mx::eval(out.q, out.kp, out.vp, out.table, out.lens);
  return out;
}

pagecheck::CallOptions options(const Shape& s) {
  return {s.page_size, 1.f / std::sqrt(static_cast<float>(s.D)), s.causal, s.window, 0.f, s.kv_code,
          /*packed=*/false};
}

pagecheck::CallArrays arrays(const Batch& x) {
  return {x.q, x.kp, x.vp, x.table, x.lens, std::nullopt, std::nullopt, x.k_scale, x.v_scale};
}

mx::array attend(const Shape& s, const Batch& x, mx::StreamOrDevice stream = {}) {
  return pagecheck::paged_attention(arrays(x), options(s), stream).first;
}

// The eager entry: computed in the calling thread, returned evaluated.
mx::array attend_now(const Shape& s, const Batch& x) {
  return pagecheck::paged_attention_now(arrays(x), options(s)).first;
}

std::vector<uint8_t> bytes(mx::array a) {
  mx::eval(a);
  const auto* p = a.data<uint8_t>();
  return std::vector<uint8_t>(p, p + a.nbytes());
}

// Live requests (context > 0) must come out finite: a NaN means an unread slot was read.
void check_finite(const Shape& s, mx::array out) {
  const mx::array f = mx::astype(out, mx::float32);
  mx::eval(f);
  const float* p = f.data<float>();
  const size_t per_request = static_cast<size_t>(s.Hq) * s.L * s.D;
  for (size_t b = 0; b < s.context_lens.size(); ++b) {
    for (size_t i = 0; i < per_request; ++i) {
      if (!std::isfinite(p[b * per_request + i])) {
        fail(std::string(s.name) + ": non-finite output in request " + std::to_string(b));
        return;
      }
    }
  }
}

std::vector<Shape> shapes() {
  std::vector<Shape> all;
  for (mx::Dtype dt : {mx::float32, mx::bfloat16, mx::float16}) {
    // decode schedule (L <= 8): several chunks of 256 keys, an empty slot, a short row
    all.push_back({"decode-L1", {600, 1, 0, 257}, 1, 8, 2, 64, 16, true, 0, dt});
    all.push_back({"decode-L4-window", {700, 4, 300}, 4, 8, 2, 48, 5, true, 300, dt});
    all.push_back({"decode-L2-unmasked", {520, 0, 33}, 2, 4, 4, 32, 1, false, 0, dt});
    // prefill schedule (L > 8): query blocks of 16 against chunks, GQA 4
    all.push_back({"prefill-L40", {300, 40, 0}, 40, 8, 2, 64, 16, true, 0, dt});
    all.push_back({"prefill-L20-window", {530, 20}, 20, 4, 1, 40, 7, true, 100, dt});
    // quantized pages, both schedules
    all.push_back({"decode-L1-e5m2", {600, 0, 257}, 1, 8, 2, 64, 16, true, 0, dt, pagecheck::kKvFp8E5M2});
    all.push_back({"prefill-L40-int8", {300, 40}, 40, 8, 2, 48, 16, true, 0, dt, pagecheck::kKvInt8});
  }
  return all;
}

const char* dtype_name(mx::Dtype dt) {
  return dt == mx::float32 ? "f32" : dt == mx::bfloat16 ? "bf16" : "f16";
}

void check_thread_invariance(const std::vector<Shape>& all, const std::vector<Batch>& batches,
                             std::vector<std::vector<uint8_t>>& reference) {
  pagecheck::set_num_threads(1);
  reference.clear();
  for (size_t i = 0; i < all.size(); ++i) {
    const mx::array out = attend(all[i], batches[i]);
    reference.push_back(bytes(out));
    check_finite(all[i], out);
  }
  for (int n : {2, 3, 4, 8}) {
    pagecheck::set_num_threads(n);
    for (size_t i = 0; i < all.size(); ++i) {
      if (bytes(attend(all[i], batches[i])) != reference[i]) {
        fail(std::string(all[i].name) + "-" + dtype_name(all[i].dtype) + ": " + std::to_string(n) +
             " workers differ from 1 worker");
      }
    }
  }
}

void check_two_streams(const std::vector<Shape>& all, const std::vector<Batch>& batches,
                       const std::vector<std::vector<uint8_t>>& reference) {
  pagecheck::set_num_threads(3);
  const mx::Stream s1 = mx::new_stream(mx::Device::cpu), s2 = mx::new_stream(mx::Device::cpu);
  for (size_t i = 0; i + 1 < all.size(); i += 2) {
    mx::array a = attend(all[i], batches[i], s1), b = attend(all[i + 1], batches[i + 1], s2);
    mx::eval(a, b);
    if (bytes(a) != reference[i] || bytes(b) != reference[i + 1]) {
      fail(std::string(all[i].name) + "/" + all[i + 1].name + ": two streams differ from 1 worker");
    }
  }
}

// Eager calls from two threads at once while a lazy call runs on a stream thread: the three
// callers share the worker pool, and each gives the 1-worker bytes.
void check_now_beside_streams(const std::vector<Shape>& all, const std::vector<Batch>& batches,
                              const std::vector<std::vector<uint8_t>>& reference) {
  pagecheck::set_num_threads(3);
  const mx::Stream stream = mx::new_stream(mx::Device::cpu);
  for (size_t i = 0; i + 2 < all.size(); i += 3) {
    std::vector<uint8_t> first, second;
    std::thread a([&] { first = bytes(attend_now(all[i], batches[i])); });
    std::thread b([&] { second = bytes(attend_now(all[i + 1], batches[i + 1])); });
    mx::array lazy = attend(all[i + 2], batches[i + 2], stream);
    mx::eval(lazy);
    a.join();
    b.join();
    if (first != reference[i] || second != reference[i + 1] || bytes(lazy) != reference[i + 2]) {
      fail(std::string(all[i].name) + "/" + all[i + 1].name + "/" + all[i + 2].name +
           ": eager calls beside a stream differ from 1 worker");
    }
  }
}

void check_concurrent_callers() {
  pagecheck::set_num_threads(4);
  constexpr int kCallers = 3, kLoops = 20, kItems = 97;
  std::vector<std::atomic<int>> hits(kCallers * kLoops * kItems);
  for (auto& h : hits) h.store(0);
  std::vector<std::thread> callers;
  for (int c = 0; c < kCallers; ++c) {
    callers.emplace_back([&, c] {
      for (int loop = 0; loop < kLoops; ++loop) {
        std::atomic<int>* base = hits.data() + (static_cast<size_t>(c) * kLoops + loop) * kItems;
        pagecheck::parallel_for(kItems, [base](int64_t i) { base[i].fetch_add(1); });
      }
    });
  }
  std::thread resizer([] {
    for (int n : {2, 5, 1, 3, 4}) pagecheck::set_num_threads(n);
  });
  for (auto& t : callers) t.join();
  resizer.join();
  for (size_t i = 0; i < hits.size(); ++i) {
    if (hits[i].load() != 1) {
      fail("parallel_for: item " + std::to_string(i) + " ran " + std::to_string(hits[i].load()) +
           " times");
      return;
    }
  }
}

// The caller never waits for a worker that takes no item (held workers, as if never
// scheduled: the loop runs in the caller alone), does wait for items workers hold longer
// than its spin (a lost wake-up would hang here), and refuses a loop past the item
// limit before running anything.
void check_caller_waits_only_for_claimed_items() {
  pagecheck::set_num_threads(3);
  const std::thread::id caller = std::this_thread::get_id();
  pagecheck::hold_workers(true);
  const int64_t before = pagecheck::worker_items();
  std::atomic<int> elsewhere{0}, ran{0};
  for (int loop = 0; loop < 50; ++loop) {
    pagecheck::parallel_for(31, [&](int64_t) {
      if (std::this_thread::get_id() != caller) elsewhere.fetch_add(1);
      ran.fetch_add(1);
    });
  }
  pagecheck::hold_workers(false);
  if (elsewhere.load() != 0 || pagecheck::worker_items() != before || ran.load() != 50 * 31) {
    fail("held workers: " + std::to_string(elsewhere.load()) + " items ran outside the caller, " +
         std::to_string(ran.load()) + " of " + std::to_string(50 * 31) + " ran");
  }
  std::vector<std::atomic<int>> hits(8);
  for (int loop = 0; loop < 20; ++loop) {
    for (auto& h : hits) h.store(0);
    pagecheck::parallel_for(8, [&](int64_t i) {
      if (i % 3 == 1) std::this_thread::sleep_for(std::chrono::milliseconds(2));
      hits[i].fetch_add(1);
    });
    for (size_t i = 0; i < hits.size(); ++i) {
      if (hits[i].load() != 1) fail("long items: item " + std::to_string(i) + " done " + std::to_string(hits[i].load()) + " times at return");
    }
  }
  bool threw = false;
  std::atomic<int> called{0};
  try {
    pagecheck::parallel_for(int64_t{1} << 32, [&](int64_t) { called.fetch_add(1); });
  } catch (const std::length_error&) {
    threw = true;
  }
  if (!threw || called.load() != 0) fail("parallel_for of 2^32 items: no length_error, or items ran");
}

void check_write_path() {
  pagecheck::set_num_threads(4);
  // pool [P=5, Hkv=2, ps=4, D=16] of NaN; write positions 0..5 of one request into
  // pages 3 and 1, then attend over them: finite, and equal to the 1-worker result.
  const int P = 5, Hkv = 2, ps = 4, D = 16, T = 6;
  mx::array kp = mx::full({P, Hkv, ps, D}, NAN, mx::float32);
  mx::array vp = mx::full({P, Hkv, ps, D}, NAN, mx::float32);
  mx::eval(kp, vp);
  std::vector<float> rows(static_cast<size_t>(T) * Hkv * D);
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = std::sin(0.37f * static_cast<float>(i));
  std::vector<int64_t> slots{12, 13, 14, 15, 4, 5};  // page 3 slots 0-3, page 1 slots 0-1
  const mx::array r = mx::array(rows.begin(), {T, Hkv, D});
  const mx::array sl = mx::array(slots.begin(), {T}, mx::int64);
  const int64_t copies = pagecheck::pool_copies();
  kp = pagecheck::write_slots(kp, r, sl);
  vp = pagecheck::write_slots(vp, mx::negative(r), sl);
  mx::eval(kp, vp);
  if (pagecheck::pool_copies() != copies) fail("write_slots copied a donatable pool");
  std::vector<float> q(static_cast<size_t>(4) * T * D);
  for (size_t i = 0; i < q.size(); ++i) q[i] = std::cos(0.11f * static_cast<float>(i));
  const std::vector<int32_t> table{3, 1}, lens{T};
  const Shape s{"write-path", {T}, T, 4, Hkv, D, ps, true, 0, mx::float32};
  Batch x{mx::array(q.begin(), {1, 4, T, D}), kp, vp, mx::array(table.begin(), {1, 2}),
          mx::array(lens.begin(), {1}, mx::int32)};
  const mx::array out = attend(s, x);
  check_finite(s, out);
  const auto many = bytes(out);
  pagecheck::set_num_threads(1);
  if (bytes(attend(s, x)) != many) fail("write-path: 4 workers differ from 1 worker");
}

}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 1;
  const std::vector<Shape> all = shapes();
  std::vector<Batch> batches;
  for (size_t i = 0; i < all.size(); ++i) batches.push_back(make_batch(all[i], 1000 + i));
  std::vector<std::vector<uint8_t>> reference;
  for (int round = 0; round < rounds; ++round) {
    check_thread_invariance(all, batches, reference);
    check_two_streams(all, batches, reference);
    check_now_beside_streams(all, batches, reference);
    check_concurrent_callers();
    check_caller_waits_only_for_claimed_items();
  }
  check_write_path();
  if (g_failures) {
    std::fprintf(stderr, "thread_driver: %d failure(s)\n", g_failures);
    return 1;
  }
  std::printf("thread_driver: %zu shapes x workers {1,2,3,4,8}, two streams, eager calls beside a stream, "
              "concurrent callers, the pool's waits, write path: OK\n", all.size());
  return 0;
}
