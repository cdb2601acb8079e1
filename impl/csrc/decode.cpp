// Decode schedule (L <= 8): split the context into chunks, attend every chunk in
// parallel, then merge each row's chunk states in ascending chunk order.
//
// Work item: (request b, chunk c, a run of consecutive KV heads). It owns all L * G
// query rows of each of its heads, so each K/V row is loaded from memory once and used
// by every query head that shares it (GQA), and it walks each page's heads in address
// order, so it streams whole pages rather than one head's slice of each (all KV heads
// per item; fewer only when there would be too few items to keep the threads busy).
// Chunk states land in a per-(b, c, g) slot; the merge pass reads a (b, g)'s slots in
// ascending c, so neither the thread count, the head runs nor the other requests can
// change the order of any floating-point operation. A bfloat16 call on AMX tiles
// attends its chunks with amx_attend_chunk instead (amx.h), as the prefill does.
#include <algorithm>

#include "amx.h"
#include "chunk.h"
#include "packed_rows.h"
#include "thread_pool.h"

namespace pagecheck {

namespace {

struct ChunkTask {
  int b, c, g0, heads;
  int64_t slot;  // state slot of (b, c, g0); the item's heads follow it
};

struct MergeGroup {
  int64_t first_slot;  // slot of (b, first chunk, g); the next chunk is Hkv slots on
  int chunks;
  int b, g;
};

// KV heads per work item: all of them, halved while the items would number fewer
// than four per thread (small batches with short contexts).
int heads_per_task(int64_t chunk_items, int Hkv) {
  int heads = Hkv;
  const int64_t want = 4 * static_cast<int64_t>(num_threads());
  while (heads > 1 && chunk_items * ((Hkv + heads - 1) / heads) < want) heads = (heads + 1) / 2;
  return heads;
}

// The rows of a one-chunk request, finished by the chunk's own task: the merge pass
// would copy its single state unchanged (merge_state; a row that saw no key keeps l = 0,
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

}  // namespace

template <class E, class KV>
void run_decode(const Problem& pr, const typename E::T* q, const typename KV::T* kpool,
                const typename KV::T* vpool, typename E::T* out, const std::vector<int>& live) {
  const int G = pr.group(), L = pr.L, Dv = pr.Dv, R = G * L, Hkv = pr.Hkv;
  std::vector<int> c_first(live.size()), c_count(live.size());
  int64_t chunk_items = 0;
  for (size_t i = 0; i < live.size(); ++i) {
    const int ctx = pr.context(live[i]);
    int first_lo, unused, last_lo, last_hi;
    pr.span(ctx, 0, first_lo, unused);  // spans move right with l: row 0 starts first,
    pr.span(ctx, L - 1, last_lo, last_hi);  // row L-1 ends last
    c_first[i] = first_lo / kChunk;
    c_count[i] = (last_hi - 1) / kChunk - c_first[i] + 1;
    chunk_items += c_count[i];
  }
  const int run = heads_per_task(chunk_items, Hkv);
  std::vector<ChunkTask> tasks;
  std::vector<MergeGroup> groups;
  int64_t slots = 0;
  for (size_t i = 0; i < live.size(); ++i) {
    for (int g = 0; g < Hkv; ++g) groups.push_back({slots + g, c_count[i], live[i], g});
    for (int c = 0; c < c_count[i]; ++c) {
      for (int g0 = 0; g0 < Hkv; g0 += run) {
        tasks.push_back({live[i], c_first[i] + c, g0, std::min(run, Hkv - g0), slots + g0});
      }
      slots += Hkv;
    }
  }
  AlignedVector<float> part_ml(slots * R * 2), part_o(slots * R * Dv);
  // The tiles take bfloat16 pools; a quantized one runs the FMA path.
  const bool tiles = std::is_same_v<E, BF16> && std::is_same_v<KV, BF16> && amx_applies(pr);
  // When every context fits one chunk, each task finishes its own rows and the merge
  // pass, a second wake-up and join of every worker, is skipped (B 1 S 128: most of the
  // kernel's time is these fixed costs).
  const bool one_chunk = std::all_of(c_count.begin(), c_count.end(), [](int c) { return c == 1; });

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
    float* ml = part_ml.data() + task.slot * R * 2;
    float* o = part_o.data() + task.slot * R * Dv;
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
    if (one_chunk) finish_chunk_rows<E>(pr, task, ml, o, out);
  });
  if (one_chunk) return;

  parallel_for(static_cast<int64_t>(groups.size()), [&](int64_t gi) {
    const MergeGroup& group = groups[gi];
    Scratch& s = Scratch::local();
    s.reserve(R, pr);
    for (int r = 0; r < R; ++r) {
      float m = kNegInf, l = 0.f;
      float* o = s.acc_o.data();
      for (int c = 0; c < group.chunks; ++c) {
        const int64_t slot = (group.first_slot + static_cast<int64_t>(c) * Hkv) * R + r;
        merge_state(m, l, o, part_ml[2 * slot], part_ml[2 * slot + 1], part_o.data() + slot * Dv, Dv,
                    pr.qk_scale);
      }
      finish_query_row<E>(pr, group.b, group.g * G + r / L, r % L, m, l, o, out);
    }
  });
}

#define PAGECHECK_RUN_DECODE(E, KV) \
  template void run_decode<E, KV>(const Problem&, const E::T*, const KV::T*, const KV::T*, E::T*, const std::vector<int>&);
PAGECHECK_FOR_EACH_POOL_TYPE(PAGECHECK_RUN_DECODE)

}  // namespace pagecheck
