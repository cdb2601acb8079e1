// The paged-attention operator as an MLX primitive (CPU only).
#pragma once

#include <optional>
#include <utility>

#include "mlx/mlx.h"
#include "mlx/primitives.h"

namespace pagecheck {

namespace mx = mlx::core;

// Pools' element format (impl/attention.py KV_CODES; contract/kv_format.py).
enum KvCode : int { kKvQueryDtype = 0, kKvFp8E4M3 = 1, kKvFp8E5M2 = 2, kKvInt8 = 3 };

// A call's options besides its arrays (impl/attention.py `_kernel_args`). window = 0
// means no window; causal = false means every query sees all ctx keys; softcap = 0 means
// none. kv_code (KvCode): the pools' element format; a quantized one (uint8 fp8 bit
// patterns or int8) takes k_scale / v_scale, float32 [] (tensor), [Hkv] (head) or
// [P, Hkv, ps] (token). packed: the pools' slices are in the tile-packed order
// (packed_layout.h; bfloat16 pools, page_size and D multiples of 32, Dv = D).
struct CallOptions {
  int page_size;
  float scale;
  bool causal;
  int window;
  float softcap;
  int kv_code;
  bool packed;
  bool operator==(const CallOptions&) const = default;
};

// The arrays of a call: five always, and the options that are arrays (absent: not used).
// alibi_slopes / sinks are float32 [Hq]; k_scale / v_scale go with a quantized kv_code.
struct CallArrays {
  mx::array query, key_pages, value_pages, block_table, context_lens;
  std::optional<mx::array> alibi_slopes, sinks, k_scale, v_scale;
};

// Builds the lazy (output [B, Hq, L, Dv], lse float32 [B, Hq, L]) pair: both come out of
// the same merge, so the lse costs no second pass. Checks only what memory safety needs
// (ranks, shapes, dtypes); the contract's specific errors are raised by the Python layer
// (impl/).
std::pair<mx::array, mx::array> paged_attention(const CallArrays& arrays, const CallOptions& options,
                                                mx::StreamOrDevice s);

// The same pair computed now, in the calling thread (and the kernels' workers), and
// returned evaluated: no graph node, so no hand-off to MLX's stream thread and back (at
// B 1 S 128 that round trip is most of a call). Inputs not yet computed are evaluated
// first (that wait is the only stream round trip left). The same checks and bits as
// paged_attention.
std::pair<mx::array, mx::array> paged_attention_now(const CallArrays& arrays, const CallOptions& options);

class PagedAttention : public mx::Primitive {
 public:
  PagedAttention(mx::Stream stream, const CallOptions& options) : mx::Primitive(stream), options_(options) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;

  const char* name() const override { return "PagedAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  CallOptions options_;
};

}  // namespace pagecheck
