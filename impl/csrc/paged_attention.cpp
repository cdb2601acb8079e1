#include "paged_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>
#include <stdexcept>

#include "kernel_info.h"
#include "output_cache.h"
#include "packed_layout.h"
// problem.h, not kernel.h: this file parses MLX's headers (2.2 s of a -O0 build), and so
// stays out of the rebuilds for a change to the kernels' row math (40 of the catalog's mutants).
#include "problem.h"
#include "mlx/backend/cpu/encoder.h"

namespace pagecheck {

namespace {

void require(bool ok, const char* what) {
  if (!ok) throw std::invalid_argument(std::string("pagecheck._kernels.paged_attention: ") + what);
}

// Whether request b can be computed without reading outside the pool. The Python
// layer rejects such input with a specific error before it gets here; this is the
// memory-safety net for a caller that bypasses it: such a request's output is NaN.
bool request_is_safe(const Problem& pr, int b) {
  const int ctx = pr.context(b);
  if (ctx < 0 || (ctx > 0 && ctx < pr.L)) return false;
  const int64_t pages = (static_cast<int64_t>(ctx) + pr.page_size - 1) / pr.page_size;
  if (pages > pr.max_pages) return false;
  const int32_t* row = pr.block_table + static_cast<int64_t>(b) * pr.max_pages;
  for (int64_t i = 0; i < pages; ++i) {
    if (row[i] < 0 || row[i] >= pr.P) return false;
  }
  return true;
}

template <class E, class KV = E>
void run(const Problem& pr, const mx::array& q, const mx::array& kp, const mx::array& vp,
         mx::array& out) {
  using T = typename E::T;
  const T* qd = q.data<T>();
  const auto* kd = kp.data<typename KV::T>();
  const auto* vd = vp.data<typename KV::T>();
  T* od = out.data<T>();
  std::vector<int> live;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int b = 0; b < pr.B; ++b) {
    const int64_t first = pr.output_offset(b, 0, 0), count = static_cast<int64_t>(pr.Hq) * pr.L * pr.Dv;
    float* lse = pr.lse + pr.row_index(b, 0, 0);
    const int64_t rows = static_cast<int64_t>(pr.Hq) * pr.L;
    if (!request_is_safe(pr, b)) {
      std::fill(od + first, od + first + count, E::store(nan));
      std::fill(lse, lse + rows, nan);
    } else if (pr.context(b) == 0) {
      std::fill(od + first, od + first + count, E::store(0.f));  // empty batch slot: no key, no sink
      std::fill(lse, lse + rows, kNegInf);
    } else {
      live.push_back(b);
    }
  }
  if (live.empty()) return;
  if (pr.L <= kDecodeMaxL) {
    run_decode<E, KV>(pr, qd, kd, vd, od, live);
  } else {
    run_prefill<E, KV>(pr, qd, kd, vd, od, live);
  }
}

// The query type E with the pools' format.
template <class E>
void run_format(int kv_code, const Problem& pr, const mx::array& q, const mx::array& kp, const mx::array& vp,
                mx::array& out) {
  switch (kv_code) {
    case kKvFp8E4M3: run<E, FP8E4M3>(pr, q, kp, vp, out); break;
    case kKvFp8E5M2: run<E, FP8E5M2>(pr, q, kp, vp, out); break;
    case kKvInt8: run<E, I8>(pr, q, kp, vp, out); break;
    default: run<E>(pr, q, kp, vp, out); break;
  }
}

// An input as the kernel reads it: row-contiguous. An array already scheduled or
// evaluated (its flags are known) that is row-contiguous goes in as it is; anything else
// through mx::contiguous. Each of those is a graph node that the CPU stream schedules
// and runs, nine a call (B 1 S 128 f32 decode, 32 calls evaluated as one graph: 47 -> 34
// us a call on 2 threads, 87 -> 50 us on one; building the call's graph 4.7 -> 2.0 us).
mx::array row_contiguous(const mx::array& a, const mx::Stream& s) {
  if (a.status() != mx::array::Status::unscheduled && a.flags().row_contiguous) return a;
  return mx::contiguous(a, false, s);
}

// The inputs a call without them passes instead: constant arrays (no graph node), made
// once and never freed, so none outlives MLX's allocator at exit.
const mx::array& no_vector() {
  static const mx::array* none = new mx::array(std::initializer_list<float>{});
  return *none;
}
const mx::array& unit_scale() {
  static const mx::array* one = new mx::array(1.f);
  return *one;
}

// A scale array's granularity (contract/kv_format.py), by its shape.
Scales scales_of(const mx::array& a) {
  Scales sc;
  sc.data = a.data<float>();
  sc.kind = a.ndim() == 0 ? Scales::kTensor : a.ndim() == 1 ? Scales::kHead : Scales::kToken;
  return sc;
}

}  // namespace

KernelInfo kernel_info() {
#if defined(__FMA__) || defined(__aarch64__)
  constexpr bool fused = true;  // numerics.h fmadd rounds once
#else
  constexpr bool fused = false;
#endif
#if defined(__AVX512F__)
  constexpr bool avx512 = true;
#else
  constexpr bool avx512 = false;
#endif
  return {kChunk, kLanes, kDecodeMaxL, fused, avx512};
}

namespace {

// Every input as the primitive and the kernel take them, in order: query, key_pages,
// value_pages, block_table, context_lens, alibi_slopes, sinks, k_scale, v_scale (the
// absent ones as constants). Checks what memory safety needs first.
std::vector<mx::array> checked_inputs(const CallArrays& a, const CallOptions& o) {
  const mx::array &query = a.query, &key_pages = a.key_pages, &value_pages = a.value_pages;
  const mx::array &block_table = a.block_table, &context_lens = a.context_lens;
  require(query.ndim() == 4, "query must be [B, Hq, L, D]");
  require(key_pages.ndim() == 4, "key_pages must be [P, Hkv, page_size, D]");
  require(value_pages.ndim() == 4 && value_pages.shape(3) >= 1, "value_pages must be [P, Hkv, page_size, Dv]");
  for (int i = 0; i < 3; ++i) require(value_pages.shape(i) == key_pages.shape(i), "value_pages must match key_pages but for Dv");
  const mx::Dtype dt = query.dtype();
  require(dt == mx::float32 || dt == mx::float16 || dt == mx::bfloat16, "dtype must be f32/f16/bf16");
  require(o.kv_code >= kKvQueryDtype && o.kv_code <= kKvInt8, "kv_code must be 0 (query dtype), 1 (e4m3), 2 (e5m2) or 3 (int8)");
  const mx::Dtype pool_dt = o.kv_code == kKvQueryDtype ? dt : o.kv_code == kKvInt8 ? mx::int8 : mx::uint8;
  require(key_pages.dtype() == pool_dt && value_pages.dtype() == pool_dt,
          "pools must have the query's dtype, or hold the codes of kv_code (uint8 fp8, int8)");
  require(block_table.ndim() == 2 && block_table.dtype() == mx::int32, "block_table must be int32 [B, max_pages]");
  require(context_lens.ndim() == 1 && context_lens.dtype() == mx::int32, "context_lens must be int32 [B]");
  const int B = query.shape(0), Hq = query.shape(1), D = query.shape(3);
  require(block_table.shape(0) == B && context_lens.shape(0) == B, "metadata batch size differs from query");
  require(key_pages.shape(1) >= 1 && Hq % key_pages.shape(1) == 0, "Hq must be a multiple of Hkv");
  require(key_pages.shape(3) == D && D >= 1, "head dim differs between query and pools");
  require(o.page_size >= 1 && key_pages.shape(2) == o.page_size, "page_size differs from the pool");
  require(o.window >= 0 && std::isfinite(o.scale), "window must be >= 0 and scale finite");
  require(o.softcap >= 0.f && std::isfinite(o.softcap), "softcap must be >= 0 (0: none) and finite");
  const int P = key_pages.shape(0), Hkv = key_pages.shape(1);
  require(!o.packed || (dt == mx::bfloat16 && o.kv_code == kKvQueryDtype && packed_fits(o.page_size, D) &&
                        value_pages.shape(3) == D),
          "packed pools are bfloat16 with page_size and D multiples of 32 and Dv = D");
  for (const auto* v : {&a.k_scale, &a.v_scale}) {
    if (!v->has_value()) continue;
    const mx::array& scale = **v;
    const bool shaped = scale.ndim() == 0 || (scale.ndim() == 1 && scale.shape(0) == Hkv) ||
                        (scale.ndim() == 3 && scale.shape(0) == P && scale.shape(1) == Hkv &&
                         scale.shape(2) == o.page_size);
    require(o.kv_code != kKvQueryDtype && scale.dtype() == mx::float32 && shaped,
            "k_scale and v_scale go with a kv_code, float32 [], [Hkv] or [P, Hkv, page_size]");
  }
  for (const auto* v : {&a.alibi_slopes, &a.sinks}) {
    require(!v->has_value() || ((*v)->dtype() == mx::float32 && (*v)->ndim() == 1 && (*v)->shape(0) == Hq),
            "alibi_slopes and sinks must be float32 [Hq]");
  }
  return {query, key_pages, value_pages, block_table, context_lens, a.alibi_slopes.value_or(no_vector()),
          a.sinks.value_or(no_vector()), a.k_scale.value_or(unit_scale()), a.v_scale.value_or(unit_scale())};
}

// An evaluated array of `shape` on such a buffer (its values are the caller's to write).
mx::array fresh(const mx::Shape& shape, mx::Dtype dtype, bool advise) {
  size_t bytes = mx::size_of(dtype);
  for (const auto d : shape) bytes *= static_cast<size_t>(d);
  return mx::array(output_buffer(bytes, advise), shape, dtype);
}

// The call itself on inputs in checked_inputs' order, all computed and row-contiguous.
void attend(const CallOptions& o, const std::vector<mx::array>& in, mx::array& out, mx::array& lse) {
  if (lse.size() == 0) return;  // B, Hq or L is 0 (a Dv of 0 is rejected)
  const mx::array &q = in[0], &kp = in[1], &vp = in[2], &bt = in[3], &cl = in[4];
  const mx::array &slopes = in[5], &sinks = in[6], &k_scale = in[7], &v_scale = in[8];
  Problem pr{};
  pr.B = q.shape(0);
  pr.Hq = q.shape(1);
  pr.L = q.shape(2);
  pr.D = q.shape(3);
  pr.Dv = vp.shape(3);
  pr.P = kp.shape(0);
  pr.Hkv = kp.shape(1);
  pr.page_size = o.page_size;
  pr.max_pages = bt.shape(1);
  pr.slopes = slopes.size() > 0 ? slopes.data<float>() : nullptr;
  pr.sinks = sinks.size() > 0 ? sinks.data<float>() : nullptr;
  pr.softcap = o.softcap;
  pr.scale = o.scale;
  pr.logits = o.softcap > 0.f || pr.slopes != nullptr || pr.sinks != nullptr;
  pr.score_sign = pr.logits || o.scale >= 0.f ? 1.f : -1.f;
  pr.qk_scale = pr.logits ? kLog2e : std::fabs(o.scale) * kLog2e;
  pr.lse_scale = pr.logits ? 1.f : std::fabs(o.scale);
  pr.lse = lse.data<float>();
  pr.causal = o.causal;
  pr.window = o.window;
  pr.block_table = bt.data<int32_t>();
  pr.context_lens = cl.data<int32_t>();
  pr.quantized = o.kv_code != kKvQueryDtype;
  pr.k_scales = scales_of(k_scale);
  pr.v_scales = scales_of(v_scale);
  pr.packed = o.packed;
  int64_t positions = 0;
  for (int b = 0; b < pr.B; ++b) positions += pr.context_lens[b];
  pr.kv_bytes = positions * pr.Hkv * (static_cast<int64_t>(pr.D) + pr.Dv) * static_cast<int64_t>(kp.itemsize());
  switch (q.dtype()) {
    case mx::float32: run_format<F32>(o.kv_code, pr, q, kp, vp, out); break;
    case mx::bfloat16: run_format<BF16>(o.kv_code, pr, q, kp, vp, out); break;
    default: run_format<F16>(o.kv_code, pr, q, kp, vp, out); break;
  }
}

std::vector<mx::Shape> shapes_out(const std::vector<mx::array>& inputs) {
  const mx::Shape& q = inputs[0].shape();
  return {{q[0], q[1], q[2], inputs[2].shape(3)}, {q[0], q[1], q[2]}};
}

}  // namespace

std::pair<mx::array, mx::array> paged_attention(const CallArrays& arrays, const CallOptions& options,
                                                mx::StreamOrDevice s) {
  auto inputs = checked_inputs(arrays, options);
  auto stream = mx::to_stream(s);
  for (auto& a : inputs) a = row_contiguous(a, stream);
  auto prim = std::make_shared<PagedAttention>(stream, options);
  auto outs = mx::array::make_arrays(shapes_out(inputs), {arrays.query.dtype(), mx::float32}, prim,
                                     std::move(inputs));
  return {outs[0], outs[1]};
}

std::pair<mx::array, mx::array> paged_attention_now(const CallArrays& arrays, const CallOptions& options) {
  auto inputs = checked_inputs(arrays, options);
  // Wait only for inputs still being computed (a pool write or a query projection on the
  // stream); then copy the few that are not row-contiguous, as the lazy call would.
  std::vector<mx::array> pending;
  for (const auto& a : inputs) {
    if (!a.is_available()) pending.push_back(a);
  }
  if (!pending.empty()) mx::eval(pending);
  pending.clear();
  for (auto& a : inputs) {
    if (!a.flags().row_contiguous) pending.push_back(a = mx::contiguous(a, false, mx::Device::cpu));
  }
  if (!pending.empty()) mx::eval(pending);
  const auto shapes = shapes_out(inputs);
  mx::array out = fresh(shapes[0], arrays.query.dtype(), true), lse = fresh(shapes[1], mx::float32, false);
  attend(options, inputs, out, lse);
  return {out, lse};
}

std::vector<mx::Shape> PagedAttention::output_shapes(const std::vector<mx::array>& inputs) {
  return shapes_out(inputs);
}

void PagedAttention::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  mx::array& out = outputs[0];
  mx::array& lse_out = outputs[1];
  out.set_data(output_buffer(out.nbytes(), true));
  lse_out.set_data(output_buffer(lse_out.nbytes(), false));
  auto& encoder = mx::cpu::get_command_encoder(stream());
  for (const auto& a : inputs) encoder.set_input_array(a);
  encoder.set_output_array(out);
  encoder.set_output_array(lse_out);
  std::vector<mx::array> in;
  in.reserve(inputs.size());
  for (const auto& a : inputs) in.push_back(mx::array::unsafe_weak_copy(a));
  encoder.dispatch([in = std::move(in), out = mx::array::unsafe_weak_copy(out),
                    lse = mx::array::unsafe_weak_copy(lse_out), o = options_]() mutable { attend(o, in, out, lse); });
}

void PagedAttention::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error(
      "pagecheck: paged_attention has no GPU kernel in this build (CPU only); "
      "run it on the CPU stream (mx.cpu) — there is no silent dense fallback");
}

bool PagedAttention::is_equivalent(const mx::Primitive& other) const {
  return options_ == static_cast<const PagedAttention&>(other).options_;
}

}  // namespace pagecheck
