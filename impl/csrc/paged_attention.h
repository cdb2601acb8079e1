// The paged-attention operator as an MLX primitive (CPU only).
#pragma once

#include "mlx/mlx.h"
#include "mlx/primitives.h"

namespace pagecheck {

namespace mx = mlx::core;

// Builds the lazy output array. Checks only what memory safety needs (ranks, shapes,
// dtypes); the contract's specific errors are raised by the Python layer (impl/).
// window = 0 means no window; causal = false means every query sees all ctx keys.
mx::array paged_attention(const mx::array& query, const mx::array& key_pages,
                          const mx::array& value_pages, const mx::array& block_table,
                          const mx::array& context_lens, int page_size, float scale, bool causal,
                          int window, mx::StreamOrDevice s = {});

class PagedAttention : public mx::UnaryPrimitive {
 public:
  PagedAttention(mx::Stream stream, int page_size, float scale, bool causal, int window)
      : mx::UnaryPrimitive(stream),
        page_size_(page_size),
        scale_(scale),
        causal_(causal),
        window_(window) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;

  const char* name() const override { return "PagedAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  int page_size_;
  float scale_;
  bool causal_;
  int window_;
};

}  // namespace pagecheck
