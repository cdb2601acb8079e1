#include "thread_pool.h"

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace pagecheck {

namespace {

// Polls of a waiting thread before it sleeps: the caller's wait for the items others
// run pauses between polls; an idle worker yields its core (sched_yield, ~0.3-1 us
// each) instead, once its hold is over.
constexpr int kSpin = 4000;

// How long a worker keeps its core after a loop, polling with pauses, before it starts
// to yield it: longer than the gap between two calls of a caller stepping call by call
// (a paged_now decode loop: ~5 us of Python), shorter than anything a thread waiting
// for that core would notice. A worker that yields at once loses its core to any other
// runnable thread, a nice-19 one or a kernel thread included, for that thread's whole
// time slice, and the caller then runs every item alone: B 1 S 128 f32 decodes beside a
// nice-19 busy loop, 2 threads, 36.0 us median (20.0 best) against vLLM's 19.6; with the
// hold 21.2 us. The AMD full run of 2026-12-04 showed the same two modes, 21 and 38 us,
// at its first case. vLLM's OpenMP workers spin for milliseconds after each call.
constexpr auto kHold = std::chrono::microseconds(50);

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

int default_threads() {
  if (const char* env = std::getenv("PAGECHECK_NUM_THREADS")) {
    char* end = nullptr;
    const long n = std::strtol(env, &end, 10);
    if (end != env && *end == '\0' && n >= 1 && n <= 1024) return static_cast<int>(n);
  }
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

// One parallel loop: its items are claimed from the pool's state word, and it is over
// when `done` reaches `n`, whoever ran them. Two slots, used by alternate generations:
// a worker still reading the slot of a loop that has ended (it read the state before
// the loop's last claim) finds that loop's own count there, never the next loop's, so
// its claim fails instead of taking an item of the next loop under the old one's
// generation. A slot is written again only two loops later, after the state word has
// moved past its generation, so no claim on it can succeed any more.
struct Loop {
  std::atomic<const std::function<void(int64_t)>*> fn{nullptr};
  std::atomic<int64_t> n{0};
  std::atomic<int64_t> done{0};
};

class Pool {
 public:
  Pool() { start(default_threads()); }
  ~Pool() { stop(); }

  int size() {
    std::lock_guard<std::mutex> run(run_mutex_);
    return size_;
  }

  void resize(int n) {
    if (n < 1) throw std::invalid_argument("number of threads must be >= 1, got " + std::to_string(n));
    std::lock_guard<std::mutex> run(run_mutex_);
    stop();
    start(n);
  }

  // The caller runs items until none is left to claim, then waits only for the items
  // workers claimed, never for a worker to show up: a worker the OS has not run since
  // the loop began takes nothing and is not waited for. (Waiting for every worker to
  // check in, as this pool did, made a loaded machine's small calls wait for a time
  // slice: B 1 S 128 f32 decode, 2 threads, beside two busy processes, 156 us median
  // against 31 us with 1 thread and vLLM's 20 us.)
  void run(int64_t n, const std::function<void(int64_t)>& fn) {
    std::lock_guard<std::mutex> run(run_mutex_);
    if (size_ == 1 || n <= 1) {
      for (int64_t i = 0; i < n; ++i) fn(i);
      return;
    }
    if (n > kMaxItems) throw std::length_error("parallel_for: " + std::to_string(n) + " items, at most 2^32 - 1");
    const uint32_t gen = generation(state_.load(std::memory_order_relaxed)) + 1;  // wraps after 2^32 loops
    Loop& loop = loops_[gen % 2];
    loop.fn.store(&fn, std::memory_order_relaxed);
    loop.n.store(n, std::memory_order_relaxed);
    loop.done.store(0, std::memory_order_relaxed);
    {
      // Under the mutex, so that a worker deciding to sleep sees either this loop or
      // the notification.
      std::lock_guard<std::mutex> lock(mutex_);
      state_.store(static_cast<uint64_t>(gen) << 32, std::memory_order_release);
    }
    wake_.notify_all();
    work(gen, false);
    const auto finished = [&] { return loop.done.load(std::memory_order_acquire) == n; };
    for (int spin = 0; spin < kSpin && !finished(); ++spin) cpu_relax();
    if (finished()) return;
    std::unique_lock<std::mutex> lock(mutex_);  // a worker runs a long item (a prefill's)
    done_.wait(lock, finished);
  }

  // Test hooks (thread_pool.h).
  void hold_workers(bool held) { held_.store(held, std::memory_order_release); }
  int64_t worker_items() const { return worker_items_.load(std::memory_order_relaxed); }
  int64_t worker_yields() const { return worker_yields_.load(std::memory_order_relaxed); }
  int64_t worker_early_yields() const { return worker_early_yields_.load(std::memory_order_relaxed); }

 private:
  static constexpr int64_t kMaxItems = std::numeric_limits<uint32_t>::max();
  static uint32_t generation(uint64_t state) { return static_cast<uint32_t>(state >> 32); }

  // Claims the next item of loop `gen`; false once it has none left or is over.
  bool claim(uint32_t gen, int64_t& item) {
    uint64_t s = state_.load(std::memory_order_acquire);
    for (;;) {
      if (generation(s) != gen) return false;
      const int64_t i = static_cast<int64_t>(s & kMaxItems);
      if (i >= loops_[gen % 2].n.load(std::memory_order_relaxed)) return false;
      if (state_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel, std::memory_order_acquire)) {
        item = i;
        return true;
      }
    }
  }

  // Runs items of loop `gen` while there are any to claim. Whoever finishes the last
  // one wakes the caller if it sleeps (its wait checks the count under the mutex).
  void work(uint32_t gen, bool by_worker) {
    Loop& loop = loops_[gen % 2];
    for (int64_t i; claim(gen, i);) {
      const int64_t n = loop.n.load(std::memory_order_relaxed);  // read while the loop is surely this one
      (*loop.fn.load(std::memory_order_relaxed))(i);
      if (by_worker) worker_items_.fetch_add(1, std::memory_order_relaxed);
      if (loop.done.fetch_add(1, std::memory_order_acq_rel) + 1 == n) {
        { std::lock_guard<std::mutex> lock(mutex_); }
        done_.notify_one();
      }
    }
  }

  bool has_new_loop(uint32_t seen) const {
    return generation(state_.load(std::memory_order_acquire)) != seen && !held_.load(std::memory_order_acquire);
  }

  // Polls for a new loop with pauses until `until` (the clock read every 16 polls: a
  // pause is 40-140 cycles), keeping the core (kHold's comment).
  void hold(uint32_t seen, std::chrono::steady_clock::time_point until) const {
    while (!has_new_loop(seen) && !quit_.load(std::memory_order_relaxed)) {
      for (int i = 0; i < 16; ++i) cpu_relax();
      if (std::chrono::steady_clock::now() >= until) return;
    }
  }

  // `seen` starts at the generation current when the worker was made: a worker
  // started by resize() must not take an earlier loop for a new one.
  void worker(uint32_t seen) {
    for (;;) {
      // Spin before sleeping: calls come back to back and a futex wake-up costs tens
      // of microseconds, as much as a small decode loop. First the short hold, then
      // by yielding, not by pausing: on two cores a worker that paused for its whole
      // spin (milliseconds) held its core while Python and MLX's stream thread waited
      // for one, and a quarter to a third of the 0.035 ms decodes (B 1, S 128) took
      // 0.2 ms instead; yielding, about 1 in 100 did. Only the wait changes; which
      // items run where never affects a result.
      const auto until = std::chrono::steady_clock::now() + kHold;
      hold(seen, until);
      for (int spin = 0; spin < kSpin && !has_new_loop(seen) && !quit_.load(); ++spin) {
        // The test hook's clock read: once per idle spell, beside a sched_yield (~0.3-1 us).
        if (spin == 0 && std::chrono::steady_clock::now() < until) {
          worker_early_yields_.fetch_add(1, std::memory_order_relaxed);
        }
        worker_yields_.fetch_add(1, std::memory_order_relaxed);
        sched_yield();
      }
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return quit_ || has_new_loop(seen); });
        if (quit_) return;
        seen = generation(state_.load(std::memory_order_acquire));
      }
      work(seen, true);
    }
  }

  void start(int n) {
    size_ = n;
    quit_ = false;
    const uint32_t current = generation(state_.load());
    for (int i = 1; i < n; ++i) workers_.emplace_back([this, current] { worker(current); });
  }

  void stop() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      quit_ = true;
    }
    wake_.notify_all();
    for (auto& w : workers_) w.join();
    workers_.clear();
  }

  std::mutex run_mutex_;  // one parallel loop (or resize) at a time
  std::mutex mutex_;      // a decision to sleep, against a new loop, its end or quit_
  std::condition_variable wake_, done_;
  std::vector<std::thread> workers_;
  // The loop now: its generation (counting from 1) in the high 32 bits, its next
  // unclaimed item in the low 32; one compare-and-swap claims an item of that loop only.
  std::atomic<uint64_t> state_{0};
  Loop loops_[2];
  int size_ = 1;
  std::atomic<bool> quit_{false};
  std::atomic<bool> held_{false};
  std::atomic<int64_t> worker_items_{0};
  std::atomic<int64_t> worker_yields_{0};
  std::atomic<int64_t> worker_early_yields_{0};
};

Pool& pool() {
  static Pool p;
  return p;
}

}  // namespace

int num_threads() { return pool().size(); }
void set_num_threads(int n) { pool().resize(n); }
void parallel_for(int64_t n, const std::function<void(int64_t)>& fn) { pool().run(n, fn); }
void hold_workers(bool held) { pool().hold_workers(held); }
int64_t worker_items() { return pool().worker_items(); }
int64_t worker_yields() { return pool().worker_yields(); }
int64_t worker_early_yields() { return pool().worker_early_yields(); }

}  // namespace pagecheck
