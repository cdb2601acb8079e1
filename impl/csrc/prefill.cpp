// Prefill schedule (L > 8): a block of query positions against the K/V chunks it can
// see, chunk after chunk, each chunk's state folded into the rows' running state.
//
// Work item: (request b, KV head g, block of kQueryBlock positions), i.e. up to
// kQueryBlock * G query rows sharing every K/V row they load. Chunks wholly past the
// block's last visible key (causal) or before its first (window) are never visited.
// The per-row arithmetic is attend_chunk + merge_state in ascending chunk order, the
// same calls the decode schedule makes, so the last row of a prefill equals a
// one-token decode at that position bit for bit (REFERENCE.md invariant 8). On AMX tiles
// (bfloat16, amx.h) both schedules call amx_attend_chunk instead, with the same effect.
#include <atomic>
#include <optional>
#include <stdexcept>
#include <string>

#include "amx.h"
#include "chunk.h"
#include "packed_rows.h"
#include "thread_pool.h"

namespace pagecheck {

namespace {

// 64 positions: each K block and V chunk a task loads (and, for a float32 pool that
// starts mid cache line or a half-type pool, copies into scratch) serves 64 x G rows;
// at 16 the copies were a tenth of the time (L 2048 f32: 137 -> 126 ms, 2 threads).
constexpr int kQueryBlock = 64;

struct BlockTask {
  int b, g, l0, nq;
};

std::atomic<int64_t>& wide_rows() {
  static std::atomic<int64_t> n{0};
  return n;
}

}  // namespace

int64_t wide_value_rows() { return wide_rows().load(std::memory_order_relaxed); }

void count_wide_value_rows(int64_t rows) { wide_rows().fetch_add(rows, std::memory_order_relaxed); }

// A head's blocks last first: under a causal mask they see the most keys, and the items
// are claimed in order, so a loop ends on short blocks rather than with one thread still
// on a long one while the other waits (L = S = 512: the longest block is 8 of a head's 36
// units of work). With the value steps (value_pass.h weigh_in_groups), f32 L = S = 512 pages
// of 128 on the AMD Zen 5, 200 calls a process in turns: 5.92-6.15 -> 5.70-5.77 ms median.
std::vector<int> prefill_block_starts(int L) {
  if (L < 1) throw std::invalid_argument("prefill_block_starts: L must be at least 1, got " + std::to_string(L));
  std::vector<int> starts;
  for (int l0 = (L - 1) / kQueryBlock * kQueryBlock; l0 >= 0; l0 -= kQueryBlock) starts.push_back(l0);
  return starts;
}

template <class E, class KV>
void run_prefill(const Problem& pr, const typename E::T* q, const typename KV::T* kpool,
                 const typename KV::T* vpool, typename E::T* out, const std::vector<int>& live) {
  const int G = pr.group(), Dv = pr.Dv;
  // The tiles take bfloat16 pools; a quantized one runs the FMA path.
  const bool tiles = std::is_same_v<E, BF16> && std::is_same_v<KV, BF16> && amx_applies(pr);
  std::vector<BlockTask> tasks;
  const std::vector<int> starts = prefill_block_starts(pr.L);
  for (int b : live) {
    for (int g = 0; g < pr.Hkv; ++g) {
      for (int l0 : starts) tasks.push_back({b, g, l0, std::min(kQueryBlock, pr.L - l0)});
    }
  }

  parallel_for(static_cast<int64_t>(tasks.size()), [&](int64_t t) {
    const BlockTask& task = tasks[t];
    const int R = G * task.nq;
    Scratch& s = Scratch::local();
    s.reserve(R, pr);
    const int ctx = pr.context(task.b);
    int lo_min = ctx, hi_max = 0;
    for (int hg = 0; hg < G; ++hg) {
      for (int i = 0; i < task.nq; ++i) {
        const int r = hg * task.nq + i;
        s.heads[r] = task.g * G + hg;
        s.positions[r] = task.l0 + i;
        s.pos[r] = ctx - pr.L + task.l0 + i;
        pr.span(ctx, task.l0 + i, s.lo[r], s.hi[r]);
        lo_min = std::min(lo_min, s.lo[r]);
        hi_max = std::max(hi_max, s.hi[r]);
        s.acc_ml[2 * r] = kNegInf;
        s.acc_ml[2 * r + 1] = 0.f;
      }
    }
    std::optional<AmxTask> amx;
    if (tiles) {
      amx.emplace(std::min(16, R));
      if constexpr (std::is_same_v<E, BF16> && std::is_same_v<KV, BF16>)
        amx_load_queries(pr, q, task.b, s.heads.data(), s.positions.data(), R, 1, *amx, s);
    } else {
      load_query_rows<E>(pr, q, task.b, s.heads.data(), s.positions.data(), R, s.q32.data());
    }
    // The first chunk's states are written where the rows' merged states live: merging
    // them into states that saw no key would copy them unchanged (merge_state), and that
    // copy was 1.5% of a f32 prefill L 2048 pages of 128.
    bool first = true;
    for (int c = lo_min / kChunk; c <= (hi_max - 1) / kChunk; ++c) {
      int jlo, jhi;
      clip_to_chunk(c, R, s.lo.data(), s.hi.data(), s.clo.data(), s.chi.data(), jlo, jhi);
      if (jlo >= jhi) continue;
      float* ml = first ? s.acc_ml.data() : s.chunk_ml.data();
      float* o = first ? s.acc_o.data() : s.chunk_o.data();
      const int64_t* voff = resolve_kv_rows(pr, task.b, task.g, jlo, jhi, s);
      if constexpr (std::is_same_v<E, BF16> && std::is_same_v<KV, BF16>) {
        if (amx) {
          amx_attend_chunk(pr, kpool, vpool, s.off.data(), jlo, jhi, R, 1, s.clo.data(), s.chi.data(), *amx, s,
                           ml, o);
        }
      }
      if (!amx) {
        const ChunkRows<KV> kv = rows_of_chunk<KV>(pr, kpool, vpool, voff, jlo, jhi, 1, s);
        attend_chunk<KV>(kv.pr, kv.k, kv.v, kv.off, kv.voff, jlo, jhi, s.q32.data(), R, 1, s.clo.data(),
                         s.chi.data(), s, ml, o, /*values_by_group=*/true);
      }
      if (first) {
        first = false;
        continue;
      }
      for (int r = 0; r < R; ++r) {
        merge_state(s.acc_ml[2 * r], s.acc_ml[2 * r + 1], s.acc_o.data() + static_cast<int64_t>(r) * Dv,
                    s.chunk_ml[2 * r], s.chunk_ml[2 * r + 1],
                    s.chunk_o.data() + static_cast<int64_t>(r) * Dv, Dv, pr.qk_scale);
      }
    }
    for (int r = 0; r < R; ++r) {
      finish_query_row<E>(pr, task.b, s.heads[r], s.positions[r], s.acc_ml[2 * r], s.acc_ml[2 * r + 1],
                          s.acc_o.data() + static_cast<int64_t>(r) * Dv, out);
    }
  });
}

#define PAGECHECK_RUN_PREFILL(E, KV) \
  template void run_prefill<E, KV>(const Problem&, const E::T*, const KV::T*, const KV::T*, E::T*, const std::vector<int>&);
PAGECHECK_FOR_EACH_POOL_TYPE(PAGECHECK_RUN_PREFILL)

}  // namespace pagecheck
