// Decode schedule (L <= 8): split the context into chunks, attend every chunk in
// parallel, then merge each row's chunk states in ascending chunk order.
//
// Work item: (request b, KV head g, chunk c). It owns all L * G query rows of the
// group, so each K/V row is loaded from memory once and used by every query head
// that shares it (GQA). Chunk states land in a per-task slot; the merge pass reads a
// group's slots in ascending c, so neither the thread count nor the other requests
// can change the order of any floating-point operation.
#include "kernel.h"
#include "thread_pool.h"

namespace pagecheck {

namespace {

struct ChunkTask {
  int b, g, c;
};

struct MergeGroup {
  int64_t first_task;
  int chunks;
  int b, g;
};

}  // namespace

template <class E>
void run_decode(const Problem& pr, const typename E::T* q, const typename E::T* kpool,
                const typename E::T* vpool, typename E::T* out, const std::vector<int>& live) {
  const int G = pr.group(), L = pr.L, D = pr.D, R = G * L;
  std::vector<ChunkTask> tasks;
  std::vector<MergeGroup> groups;
  for (int b : live) {
    const int ctx = pr.context(b);
    int first_lo, unused, last_lo, last_hi;
    pr.span(ctx, 0, first_lo, unused);  // spans move right with l: row 0 starts first,
    pr.span(ctx, L - 1, last_lo, last_hi);  // row L-1 ends last
    const int c_first = first_lo / kChunk, c_last = (last_hi - 1) / kChunk;
    for (int g = 0; g < pr.Hkv; ++g) {
      groups.push_back({static_cast<int64_t>(tasks.size()), c_last - c_first + 1, b, g});
      for (int c = c_first; c <= c_last; ++c) tasks.push_back({b, g, c});
    }
  }
  std::vector<float> part_ml(tasks.size() * R * 2), part_o(tasks.size() * R * D);

  parallel_for(static_cast<int64_t>(tasks.size()), [&](int64_t t) {
    const ChunkTask& task = tasks[t];
    Scratch& s = Scratch::local();
    s.reserve(R, D);
    const int ctx = pr.context(task.b);
    for (int hg = 0; hg < G; ++hg) {
      for (int l = 0; l < L; ++l) {
        const int r = hg * L + l;
        s.heads[r] = task.g * G + hg;
        s.positions[r] = l;
        pr.span(ctx, l, s.lo[r], s.hi[r]);
      }
    }
    int jlo, jhi;
    clip_to_chunk(task.c, R, s.lo.data(), s.hi.data(), s.clo.data(), s.chi.data(), jlo, jhi);
    load_query_rows<E>(pr, q, task.b, s.heads.data(), s.positions.data(), R, s.q32.data());
    resolve_rows(pr, task.b, task.g, jlo, jhi, s.off.data());
    attend_chunk<E>(pr, kpool, vpool, s.off.data(), jlo, jhi, s.q32.data(), R, s.clo.data(),
                    s.chi.data(), s, part_ml.data() + t * R * 2,
                    part_o.data() + t * R * D);
  });

  parallel_for(static_cast<int64_t>(groups.size()), [&](int64_t gi) {
    const MergeGroup& group = groups[gi];
    Scratch& s = Scratch::local();
    s.reserve(R, D);
    for (int r = 0; r < R; ++r) {
      float m = kNegInf, l = 0.f;
      float* o = s.acc_o.data();
      for (int c = 0; c < group.chunks; ++c) {
        const int64_t slot = (group.first_task + c) * R + r;
        merge_state(m, l, o, part_ml[2 * slot], part_ml[2 * slot + 1], part_o.data() + slot * D, D,
                    pr.qk_scale);
      }
      const int h = group.g * G + r / L;
      finish_row<E>(l, o, out + pr.query_offset(group.b, h, r % L), D);
    }
  });
}

template void run_decode<F32>(const Problem&, const float*, const float*, const float*, float*,
                              const std::vector<int>&);
template void run_decode<BF16>(const Problem&, const uint16_t*, const uint16_t*, const uint16_t*,
                               uint16_t*, const std::vector<int>&);
template void run_decode<F16>(const Problem&, const uint16_t*, const uint16_t*, const uint16_t*,
                              uint16_t*, const std::vector<int>&);

}  // namespace pagecheck
