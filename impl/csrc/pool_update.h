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
// primitive its own copy of the input list, so such a pool could never be donated. A
// quantized pool's token scales are therefore updated by their own primitive
// (write_scales) beside the code write (quantize_slots), both fed by one row_scales.
#pragma once

#include <cstdint>

#include "mlx/mlx.h"
#include "mlx/primitives.h"

namespace pagecheck {

namespace mx = mlx::core;

// Writes rows[t] ([T, Hkv, D]) into position slots[t] (int64 [T], slot = page *
// page_size + offset) of every KV head of `pages` ([P, Hkv, page_size, D]). Slots
// outside the pool are skipped: the Python layer rejects them first, this only keeps
// memory safe. order (packed_layout.h PageOrder): rows, or a 16-bit pool's tile-packed
// key or value slices (page_size and D multiples of 32).
mx::array write_slots(const mx::array& pages, const mx::array& rows, const mx::array& slots, int order = 0,
                      mx::StreamOrDevice s = {});

// Copies whole pages src[i] -> dst[i] (int32 [n]): the copy of copy-on-write. `pages` is
// any page-major array [P, ...]: a K/V pool, or its token scales [P, Hkv, page_size].
mx::array copy_pages(const mx::array& pages, const mx::array& src, const mx::array& dst,
                     mx::StreamOrDevice s = {});

// The quantizing write (quantize.h): encodes rows[t] ([T, Hkv, D], float32 / float16 /
// bfloat16) as codes of kv_code (paged_attention.h KvCode: uint8 fp8 bit patterns or
// int8) into slot slots[t] of `pages` ([P, Hkv, page_size, D]), code = encode(x / s) with
// s from `scale`: float32 [] (tensor), [Hkv] (head) or [T, Hkv] (one per row: token
// scales from row_scales). Slots outside the pool are skipped, as in write_slots.
mx::array quantize_slots(const mx::array& pages, const mx::array& rows, const mx::array& slots,
                         const mx::array& scale, int kv_code, mx::StreamOrDevice s = {});

// Each row's token scale for kv_code, float32 [T, Hkv] (quantize.h row_scale: max|x| /
// max finite; 1.0 for a zero row, NaN for a row with NaN or inf). A fresh array.
mx::array row_scales(const mx::array& rows, int kv_code, mx::StreamOrDevice s = {});

// Writes scale[t] ([T, Hkv] float32) into slot slots[t] of `scales` ([P, Hkv, page_size]
// float32), in place like write_slots: the token scales beside a quantized pool.
mx::array write_scales(const mx::array& scales, const mx::array& scale, const mx::array& slots,
                       mx::StreamOrDevice s = {});

// Number of updates that could not reuse the pool buffer and copied it whole.
int64_t pool_copies();

class PoolUpdate : public mx::UnaryPrimitive {
 public:
  enum class Kind { WriteSlots, CopyPages, QuantizeSlots };
  // kv_code: a quantizing write's codes; order: a plain write's page order (packed_layout.h).
  PoolUpdate(mx::Stream stream, Kind kind, int kv_code = 0, int order = 0)
      : mx::UnaryPrimitive(stream), kind_(kind), kv_code_(kv_code), order_(order) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;

  const char* name() const override {
    return kind_ == Kind::WriteSlots ? "PoolWriteSlots" : kind_ == Kind::CopyPages ? "PoolCopyPages"
                                                                                   : "PoolQuantizeSlots";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const PoolUpdate&>(other);
    return kind_ == o.kind_ && kv_code_ == o.kv_code_ && order_ == o.order_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  Kind kind_;
  int kv_code_;
  int order_;
};

// row_scales as a primitive: reads the rows, writes a fresh [T, Hkv] float32 array.
class RowScales : public mx::UnaryPrimitive {
 public:
  RowScales(mx::Stream stream, int kv_code) : mx::UnaryPrimitive(stream), kv_code_(kv_code) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;

  const char* name() const override { return "PoolRowScales"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return kv_code_ == static_cast<const RowScales&>(other).kv_code_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {{inputs[0].shape(0), inputs[0].shape(1)}};
  }

 private:
  int kv_code_;
};

}  // namespace pagecheck
