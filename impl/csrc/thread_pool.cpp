#include "thread_pool.h"

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace pagecheck {

namespace {

// Polls of a waiting thread before it sleeps: the caller's wait for the workers pauses
// between polls; an idle worker yields its core (sched_yield, ~0.3-1 us each) instead.
constexpr int kSpin = 4000;

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

  void run(int64_t n, const std::function<void(int64_t)>& fn) {
    std::lock_guard<std::mutex> run(run_mutex_);
    if (size_ == 1 || n <= 1) {
      for (int64_t i = 0; i < n; ++i) fn(i);
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      fn_ = &fn;
      n_ = n;
      next_.store(0);
      busy_ = static_cast<int>(workers_.size());
      ++generation_;
    }
    wake_.notify_all();
    drain();
    for (int spin = 0; spin < kSpin && busy_.load(std::memory_order_acquire) != 0; ++spin) cpu_relax();
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [&] { return busy_ == 0; });
    fn_ = nullptr;
  }

 private:
  void drain() {
    for (int64_t i = next_.fetch_add(1); i < n_; i = next_.fetch_add(1)) (*fn_)(i);
  }

  // `seen` starts at the generation current when the worker was made: a worker
  // started by resize() must not take an earlier loop for a new one.
  void worker(uint64_t seen) {
    for (;;) {
      // Spin a little before sleeping: a kernel call runs two loops back to back and
      // a futex wake-up costs tens of microseconds, as much as a small decode loop.
      // Spin by yielding, not by pausing: on two cores a worker that pauses holds its
      // core for the whole spin while Python and MLX's stream thread wait for one, and
      // a quarter to a third of the 0.035 ms decodes (B 1, S 128) took 0.2 ms instead;
      // yielding, about 1 in 100 did. Only the wait changes; which items run where
      // never affects a result.
      for (int spin = 0; spin < kSpin && generation_.load(std::memory_order_acquire) == seen && !quit_.load();
           ++spin) {
        sched_yield();
      }
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return quit_ || generation_ != seen; });
        if (quit_) return;
        seen = generation_;
      }
      drain();
      std::lock_guard<std::mutex> lock(mutex_);
      if (--busy_ == 0) done_.notify_one();
    }
  }

  void start(int n) {
    size_ = n;
    quit_ = false;
    const uint64_t current = generation_;
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
  std::mutex mutex_;      // guards the fields below
  std::condition_variable wake_, done_;
  std::vector<std::thread> workers_;
  const std::function<void(int64_t)>* fn_ = nullptr;
  int64_t n_ = 0;
  std::atomic<int64_t> next_{0};
  std::atomic<int> busy_{0};  // written under mutex_; read without it only to spin
  int size_ = 1;
  std::atomic<uint64_t> generation_{0};
  std::atomic<bool> quit_{false};
};

Pool& pool() {
  static Pool p;
  return p;
}

}  // namespace

int num_threads() { return pool().size(); }
void set_num_threads(int n) { pool().resize(n); }
void parallel_for(int64_t n, const std::function<void(int64_t)>& fn) { pool().run(n, fn); }

}  // namespace pagecheck
