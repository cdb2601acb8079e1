// In-place updates of one layer's page pool (K or V): the write path of the serving core.
//
// Each operation returns the updated pool as a new MLX array. When the pool passed in
// is donatable (the graph holds the only reference, as impl.PagePool arranges), the
// output takes over its buffer and only the touched rows are written: cost O(rows
// written), independent of the pool size. Otherwise MLX's functional semantics force a
// whole-pool copy first; each such copy is counted in `pool_copies()` so tests and
// benchmarks can prove the serving path never takes it.
//
// One output per primitive on purpose: MLX gives every output of a multi-output
// primitive its own copy of the input list, so such a pool could never be donated.
#pragma once

#include <cstdint>

#include "mlx/mlx.h"
#include "mlx/primitives.h"

namespace pagecheck {

namespace mx = mlx::core;

// Writes rows[t] ([T, Hkv, D]) into position slots[t] (int64 [T], slot = page *
// page_size + offset) of every KV head of `pages` ([P, Hkv, page_size, D]). Slots
// outside the pool are skipped: the Python layer rejects them first, this only keeps
// memory safe.
mx::array write_slots(const mx::array& pages, const mx::array& rows, const mx::array& slots,
                      mx::StreamOrDevice s = {});

// Copies whole pages src[i] -> dst[i] (int32 [n]): the copy of copy-on-write.
mx::array copy_pages(const mx::array& pages, const mx::array& src, const mx::array& dst,
                     mx::StreamOrDevice s = {});

// Number of updates that could not reuse the pool buffer and copied it whole.
int64_t pool_copies();

class PoolUpdate : public mx::UnaryPrimitive {
 public:
  enum class Kind { WriteSlots, CopyPages };
  PoolUpdate(mx::Stream stream, Kind kind) : mx::UnaryPrimitive(stream), kind_(kind) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;

  const char* name() const override {
    return kind_ == Kind::WriteSlots ? "PoolWriteSlots" : "PoolCopyPages";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    return kind_ == static_cast<const PoolUpdate&>(other).kind_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  Kind kind_;
};

}  // namespace pagecheck
