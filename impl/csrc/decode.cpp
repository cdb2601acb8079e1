// Decode schedule (L <= 8): split the context into chunks, attend every chunk in
// parallel, then merge each row's chunk states in ascending chunk order.
//
// Work item: (request b, chunk c, a run of consecutive KV heads). It owns all L * G
// query rows of each of its heads, so each K/V row is loaded from memory once and used
// by every query head that shares it (GQA), and it walks each page's heads in address
// order, so it streams whole pages rather than one head's slice of each (all KV heads
// per item; fewer only when there would be too few items to keep the threads busy).
// Chunk states land in a per-(b, c, g) slot; the task that finishes a (b, head run)'s
// last chunk, whichever chunk that is, merges the run's slots in ascending c, so neither
// the thread count, the head runs, the finishing order nor the other requests can
// change the order of any floating-point operation. A bfloat16 call on AMX tiles
// attends its chunks with amx_attend_chunk instead (amx.h), as the prefill does.
#include <algorithm>
#include <atomic>
#include <optional>
#include <stdexcept>

#include "amx.h"
#include "chunk.h"
#include "packed_rows.h"
#include "thread_pool.h"

namespace pagecheck {

namespace {

struct ChunkTask {
  int b, c, g0, heads;
  int64_t slot;  // state slot of (b, c, g0), the item's heads following it; none (-1)
                 // for a one-chunk request, whose task keeps its states in its scratch
  int run;       // the (b, head run) whose chunks it shares: runs[run]
};

// One request's head run over all of its chunks: merged by the task that finishes the
// last of them (`left` counts down). The merge used to be a second parallel loop, a
// wake-up and join of every worker of its own.
struct HeadRun {
  int64_t first_slot;  // slot of (b, first chunk, g0); the next chunk is Hkv slots on
  int chunks;
  std::atomic<int> left;
};

// KV heads per work item: all of them, halved while the items would number fewer than
// one per thread, or fewer than four per thread while each item would still weigh at
// least kMinItemWork keys x query positions (a chunk's keys for every head of the item).
// Smaller items cost more in their set-up than they gain in balance: on the AMD machine
// (2 threads, Hkv 8, medians in turns in one process, against the rule of four items per
// thread alone) B 1 S 128 bf16 decodes 10% faster in 2 items than in 8, B 4 S 128 2-3%
// faster in 4 than in 8 (bf16 pages of 16, f32 pages of 128); B 1 S 1024 keeps 8 items
// of 4 heads x 256 keys.
constexpr int64_t kMinItemWork = 1024;
int heads_per_task(int64_t chunk_items, int Hkv, int64_t item_keys, int L) {
  const int64_t threads = num_threads();
  int heads = Hkv;
  const auto items = [&](int h) { return chunk_items * ((Hkv + h - 1) / h); };
  while (heads > 1) {
    const int half = (heads + 1) / 2;
    const bool too_few = items(heads) < threads;
    const bool worth_it = items(heads) < 4 * threads && half * item_keys * L >= kMinItemWork;
    if (!too_few && !worth_it) break;
    heads = half;
  }
  return heads;
}

// The rows of a one-chunk request, finished by the chunk's own task without the merge,
// which would copy its single state unchanged (merge_state; a row that saw no key keeps l = 0,
// and finish_query_row reads no m then), so this is the merge's arithmetic on the same
// values.
template <class E>
void finish_chunk_rows(const Problem& pr, const ChunkTask& task, const float* ml, float* o, typename E::T* out) {
  const int L = pr.L, G = pr.group(), R = G * L;
  for (int i = 0; i < task.heads * R; ++i) {
    const int r = i % R;  // the task's rows: KV head by KV head, then query head, then position
    finish_query_row<E>(pr, task.b, (task.g0 + i / R) * G + r / L, r % L, ml[2 * i], ml[2 * i + 1],
                        o + static_cast<int64_t>(i) * pr.Dv, out);
  }
}

// The chunk states of a call's requests of several chunks, kept by the calling thread
// from one call to the next (grown, never shrunk) up to kKeptStateFloats, where a call
// needs more only in its own buffers. Allocated per call, the states of a B 16, S 32768
// decode (32 MiB: G 4 rows x Dv 128 floats per KV head and chunk of 256 keys) came from a
// fresh mmap every time, above glibc's largest threshold for reusing freed memory
// (32 MiB), and their first writes faulted in 8,192 zeroed 4 KiB pages: 3.7-4 ms a call
// here (a numpy array of 33 MiB filled one float per 4 KiB page; 8 MiB, reused: 0.01 ms),
// against a 90 ms bf16 call. Every state is written by its task before the merge reads
// it, so what a kept buffer held from an earlier call is never read.
constexpr size_t kKeptStateFloats = size_t{16} << 20;  // 64 MiB of states (o and ml)

struct KeptStates {
  AlignedVector<float> ml, o;
  static KeptStates& of_this_thread() {
    thread_local KeptStates kept;
    return kept;
  }
};

inline bool keeps_states(size_t floats) { return floats <= kKeptStateFloats; }

// n floats of `kept` (grown to n where it holds fewer), or of `own` where the call's
// states (`total`: ml's and o's) are more than the thread keeps.
float* state_floats(AlignedVector<float>& kept, size_t n, size_t total, std::optional<UnsetArray<float>>& own) {
  if (!keeps_states(total)) return own.emplace(n).data();
  if (kept.size() < n) AlignedVector<float>(n).swap(kept);  // zeroed once, at its first size
  return kept.data();
}

}  // namespace

template <class E, class KV>
void run_decode(const Problem& pr, const typename E::T* q, const typename KV::T* kpool,
                const typename KV::T* vpool, typename E::T* out, const std::vector<int>& live) {
  const int G = pr.group(), L = pr.L, Dv = pr.Dv, R = G * L, Hkv = pr.Hkv;
  std::vector<int> c_first(live.size()), c_count(live.size());
  int64_t chunk_items = 0, keys = 0;
  for (size_t i = 0; i < live.size(); ++i) {
    const int ctx = pr.context(live[i]);
    int first_lo, unused, last_lo, last_hi;
    pr.span(ctx, 0, first_lo, unused);  // spans move right with l: row 0 starts first,
    pr.span(ctx, L - 1, last_lo, last_hi);  // row L-1 ends last
    c_first[i] = first_lo / kChunk;
    c_count[i] = (last_hi - 1) / kChunk - c_first[i] + 1;
    chunk_items += c_count[i];
    keys += last_hi - first_lo;
  }
  const int run = heads_per_task(chunk_items, Hkv, (keys + chunk_items - 1) / chunk_items, L);
  const int runs_per_request = (Hkv + run - 1) / run;
  std::vector<ChunkTask> tasks;
  std::vector<HeadRun> runs(live.size() * runs_per_request);
  int64_t slots = 0;  // chunk states to merge: those of requests of several chunks only
  for (size_t i = 0; i < live.size(); ++i) {
    const bool merged = c_count[i] > 1;
    for (int k = 0; k < runs_per_request; ++k) {
      HeadRun& hr = runs[i * runs_per_request + k];
      hr.first_slot = merged ? slots + k * run : -1;
      hr.chunks = c_count[i];
      hr.left.store(c_count[i], std::memory_order_relaxed);
    }
    for (int c = 0; c < c_count[i]; ++c) {
      for (int k = 0; k < runs_per_request; ++k) {
        const int g0 = k * run;
        tasks.push_back({live[i], c_first[i] + c, g0, std::min(run, Hkv - g0), merged ? slots + g0 : -1,
                         static_cast<int>(i) * runs_per_request + k});
      }
      if (merged) slots += Hkv;
    }
  }
  // Every state is written by its task before the merge reads it (a row that saw no
  // key: ml only, and its o is never read), so the buffers are not zeroed first.
  const size_t ml_floats = static_cast<size_t>(slots) * R * 2, o_floats = static_cast<size_t>(slots) * R * Dv;
  KeptStates& kept = KeptStates::of_this_thread();
  std::optional<UnsetArray<float>> own_ml, own_o;
  float* const part_ml = state_floats(kept.ml, ml_floats, ml_floats + o_floats, own_ml);
  float* const part_o = state_floats(kept.o, o_floats, ml_floats + o_floats, own_o);
  // The tiles take bfloat16 pools; a quantized one runs the FMA path.
  const bool tiles = std::is_same_v<E, BF16> && std::is_same_v<KV, BF16> && amx_applies(pr);

  parallel_for(static_cast<int64_t>(tasks.size()), [&](int64_t t) {
    const ChunkTask& task = tasks[t];
    const int rows = task.heads * R;
    Scratch& s = Scratch::local();
    s.reserve(rows, pr);
    const int ctx = pr.context(task.b);
    for (int h = 0; h < task.heads; ++h) {
      for (int hg = 0; hg < G; ++hg) {
        for (int l = 0; l < L; ++l) {
          const int r = (h * G + hg) * L + l;
          s.heads[r] = (task.g0 + h) * G + hg;
          s.positions[r] = l;
          s.pos[r] = ctx - L + l;
          pr.span(ctx, l, s.lo[r], s.hi[r]);
        }
      }
    }
    int jlo, jhi;
    clip_to_chunk(task.c, rows, s.lo.data(), s.hi.data(), s.clo.data(), s.chi.data(), jlo, jhi);
    const int64_t* voff = resolve_kv_rows(pr, task.b, task.g0, jlo, jhi, s);
    HeadRun& hr = runs[task.run];
    const bool alone = hr.chunks == 1;  // finished here, from the task's own scratch
    float* ml = alone ? s.chunk_ml.data() : part_ml + task.slot * R * 2;
    float* o = alone ? s.chunk_o.data() : part_o + task.slot * R * Dv;
    bool attended = false;
    if constexpr (std::is_same_v<E, BF16> && std::is_same_v<KV, BF16>) {
      if (tiles) {
        AmxTask amx(std::min(16, R));
        amx_load_queries(pr, q, task.b, s.heads.data(), s.positions.data(), rows, task.heads, amx, s);
        amx_attend_chunk(pr, kpool, vpool, s.off.data(), jlo, jhi, rows, task.heads, s.clo.data(), s.chi.data(),
                         amx, s, ml, o);
        attended = true;
      }
    }
    if (!attended) {
      load_query_rows<E>(pr, q, task.b, s.heads.data(), s.positions.data(), rows, s.q32.data());
      const ChunkRows<KV> kv = rows_of_chunk<KV>(pr, kpool, vpool, voff, jlo, jhi, task.heads, s);
      attend_chunk<KV>(kv.pr, kv.k, kv.v, kv.off, kv.voff, jlo, jhi, s.q32.data(), rows, task.heads, s.clo.data(),
                       s.chi.data(), s, ml, o);
    }
    if (alone) {
      finish_chunk_rows<E>(pr, task, ml, o, out);
      return;
    }
    // The last chunk of the run to finish merges it: acq_rel, so this task sees the
    // states the other chunks' tasks wrote before their own count-down.
    if (hr.left.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
    for (int h = 0; h < task.heads; ++h) {
      const int g = task.g0 + h;
      for (int r = 0; r < R; ++r) {
        float m = kNegInf, l = 0.f;
        float* acc = s.acc_o.data();
        for (int c = 0; c < hr.chunks; ++c) {
          const int64_t slot = (hr.first_slot + h + static_cast<int64_t>(c) * Hkv) * R + r;
          merge_state(m, l, acc, part_ml[2 * slot], part_ml[2 * slot + 1], part_o + slot * Dv, Dv,
                      pr.qk_scale);
        }
        finish_query_row<E>(pr, task.b, g * G + r / L, r % L, m, l, acc, out);
      }
    }
  });
}

int decode_heads_per_item(int64_t chunk_items, int Hkv, int64_t item_keys, int L) {
  return heads_per_task(chunk_items, Hkv, item_keys, L);
}

int decode_value_span(int64_t value_row_bytes, int64_t kv_bytes) {
  if (value_row_bytes < 1 || kv_bytes < 0)
    throw std::invalid_argument("decode_value_span: value_row_bytes must be positive and kv_bytes not negative");
  return value_span(value_row_bytes, kv_bytes);
}

bool decode_value_asks(int64_t element_bytes, int64_t kv_bytes) {
  if ((element_bytes != 1 && element_bytes != 2 && element_bytes != 4) || kv_bytes < 0)
    throw std::invalid_argument("decode_value_asks: element_bytes must be 1, 2 or 4 and kv_bytes not negative");
  return value_asks(element_bytes, kv_bytes);
}

bool decode_keeps_states(int64_t floats) {
  if (floats < 0) throw std::invalid_argument("decode_keeps_states: floats must not be negative");
  return keeps_states(static_cast<size_t>(floats));
}

std::vector<int64_t> decode_kept_state_floats() {
  const KeptStates& kept = KeptStates::of_this_thread();
  return {static_cast<int64_t>(kept.ml.size()), static_cast<int64_t>(kept.o.size())};
}

bool pair_dots_apply(int rows_per_head, int D) { return pairs_apply<BF16>(rows_per_head, D); }

#define PAGECHECK_RUN_DECODE(E, KV) \
  template void run_decode<E, KV>(const Problem&, const E::T*, const KV::T*, const KV::T*, E::T*, const std::vector<int>&);
PAGECHECK_FOR_EACH_POOL_TYPE(PAGECHECK_RUN_DECODE)

}  // namespace pagecheck
