#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "fma_peak.h"
#include "aligned_array.h"
#include "call_key.h"
#include "huge_pages.h"
#include "kernel_info.h"
#include "metadata_check.h"
#include "output_cache.h"
#include "paged_attention.h"
#include "pool_update.h"
#include "thread_pool.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using Array = mlx::core::array;
using Opt = std::optional<Array>;

// Both attention entry points take the same arguments, as Python names them; `call`
// gets them as the C++ entries do (CallArrays gathers the arrays, CallOptions the scalar
// options), and `Tail` is what one entry adds at the end (the lazy one's stream).
template <class... Tail, class Call>
auto attention_entry(Call call) {
  return [call](const Array& q, const Array& kp, const Array& vp, const Array& bt, const Array& cl, int page_size,
                float scale, bool causal, int window, float softcap, const Opt& slopes, const Opt& sinks,
                int kv_code, const Opt& k_scale, const Opt& v_scale, bool packed, Tail... tail) {
    const pagecheck::CallArrays arrays{q, kp, vp, bt, cl, slopes, sinks, k_scale, v_scale};
    const pagecheck::CallOptions o{page_size, scale, causal, window, softcap, kv_code, packed};
    return call(arrays, o, tail...);
  };
}

template <class Entry, class... Extra>
void def_attention(nb::module_& m, const char* name, Entry entry, Extra... extra) {
  m.def(name, entry, "query"_a, "key_pages"_a, "value_pages"_a, "block_table"_a, "context_lens"_a, "page_size"_a,
        "scale"_a, "causal"_a, "window"_a, "softcap"_a = 0.f, "alibi_slopes"_a = nb::none(), "sinks"_a = nb::none(),
        "kv_code"_a = 0, "k_scale"_a = nb::none(), "v_scale"_a = nb::none(), "packed"_a = false, extra...);
}

}  // namespace

NB_MODULE(_kernels, m) {
  m.doc() = "pagecheck CPU kernels: paged attention over an MLX page pool";
  def_attention(m, "paged_attention",
                attention_entry<mlx::core::StreamOrDevice>(
                    [](const auto&... a) { return pagecheck::paged_attention(a...); }),
                nb::kw_only(), "stream"_a = nb::none(),
                "Unvalidated entry point returning (output, lse); call impl.paged_attention instead.");
  def_attention(m, "paged_attention_now",
                attention_entry([](const auto&... a) { return pagecheck::paged_attention_now(a...); }),
                nb::call_guard<nb::gil_scoped_release>(),
                "Unvalidated entry point computing (output, lse) now, in the calling thread, returned evaluated; "
                "call impl.paged_attention_now instead.");
  m.def("call_key", &pagecheck::call_key, "query"_a, "key_pages"_a, "value_pages"_a, "options"_a,
        "The memo key of a serving call's checks (impl/checked.py signature), or None.");
  m.def(
      "check_metadata",
      [](const mlx::core::array& block_table, const mlx::core::array& context_lens, int64_t page_size,
         int64_t num_pages, int64_t query_len) {
        const pagecheck::MetadataFault f =
            pagecheck::check_metadata(block_table, context_lens, page_size, num_pages, query_len);
        return nb::make_tuple(f.rule, f.request, f.context, f.column, f.page);
      },
      "block_table"_a, "context_lens"_a, "page_size"_a, "num_pages"_a, "query_len"_a,
      "The metadata's first fault as (rule, request, context, column, page): rule 0 when none, else "
      "1 context_negative, 2 context_short, 3 table_short, 4 page_id (metadata_check.h); "
      "use impl.validation.check_metadata_values instead.");
  m.def("write_slots", &pagecheck::write_slots, "pages"_a, "rows"_a, "slots"_a, "order"_a = 0, nb::kw_only(),
        "stream"_a = nb::none(),
        "Unvalidated in-place slot write (order: 0 rows, 1 / 2 tile-packed keys / values); use impl.PagePool "
        "instead.");
  m.def("copy_pages", &pagecheck::copy_pages, "pages"_a, "src"_a, "dst"_a, nb::kw_only(),
        "stream"_a = nb::none(), "Unvalidated in-place page copy; use impl.PagePool instead.");
  m.def("quantize_slots", &pagecheck::quantize_slots, "pages"_a, "rows"_a, "slots"_a, "scale"_a, "kv_code"_a,
        nb::kw_only(), "stream"_a = nb::none(),
        "Unvalidated in-place quantizing slot write (codes of kv_code); use impl.PagePool instead.");
  m.def("row_scales", &pagecheck::row_scales, "rows"_a, "kv_code"_a, nb::kw_only(), "stream"_a = nb::none(),
        "Token scales of rows [T, Hkv, D] for kv_code: float32 [T, Hkv] (max|x| / max finite; 1.0 for a zero "
        "row, NaN for a row holding NaN or inf).");
  m.def("write_scales", &pagecheck::write_scales, "scales"_a, "scale"_a, "slots"_a, nb::kw_only(),
        "stream"_a = nb::none(), "Unvalidated in-place write of token scales; use impl.PagePool instead.");
  m.def("pool_copies", &pagecheck::pool_copies,
        "How many pool updates had to copy a whole pool (0 on the in-place path).");
  m.def("num_threads", &pagecheck::num_threads, "Worker threads used by the kernels.");
  m.def("set_num_threads", &pagecheck::set_num_threads, "n"_a, "Set the kernels' worker count.");
  m.def("hold_workers", &pagecheck::hold_workers, "held"_a,
        "For tests: while held, the worker threads take no work (as if never scheduled); calls run in "
        "the calling thread alone.");
  m.def("worker_items", &pagecheck::worker_items, "For tests: items run by worker threads, not callers, so far.");
  m.def("worker_yields", &pagecheck::worker_yields, "For tests: times an idle worker yielded its core so far.");
  m.def("worker_early_yields", &pagecheck::worker_early_yields,
        "For tests: idle spells in which a worker yielded its core before its hold had passed (0 when sound).");
  m.def("decode_heads_per_item", &pagecheck::decode_heads_per_item, "chunk_items"_a, "kv_heads"_a, "item_keys"_a,
        "query_len"_a, "For tests: KV heads per work item of the decode schedule on the current worker count.");
  m.def("decode_value_span", &pagecheck::decode_value_span, "value_row_bytes"_a, "kv_bytes"_a,
        "For tests: keys a decode weighs in one span, for V rows of this many bytes in a call whose requests "
        "hold kv_bytes of K and V.");
  m.def("decode_value_asks", &pagecheck::decode_value_asks, "element_bytes"_a, "kv_bytes"_a,
        "For tests: whether a decode's value pass asks for the V rows it weighs next, for V elements of this many "
        "bytes in a call whose requests hold kv_bytes of K and V.");
  m.def("decode_keeps_states", &pagecheck::decode_keeps_states, "floats"_a,
        "For tests: whether a decode whose requests of several chunks hold this many floats of chunk states "
        "keeps them in the calling thread's buffers from call to call.");
  m.def("decode_kept_state_floats", &pagecheck::decode_kept_state_floats,
        "For tests: the calling thread's kept chunk-state buffers, in floats: [ml's, o's].");
  m.def("pair_dots_apply", &pagecheck::pair_dots_apply, "rows_per_head"_a, "head_dim"_a,
        "For tests: whether a bfloat16 call with this many query rows per KV head scores them on the pair dot "
        "product now.");
  m.def("amx_supported", &pagecheck::amx_supported,
        "Whether bfloat16 calls can run on AMX tiles here (build, CPU and Linux all allow it).");
  m.def("amx_enabled", &pagecheck::amx_enabled, "Whether bfloat16 calls run on AMX tiles now.");
  m.def("set_amx", &pagecheck::set_amx, "on"_a,
        "Switch the AMX tile path of bfloat16 calls on or off (on raises ValueError where unsupported).");
  m.def("pair_dots_supported", &pagecheck::pair_dots_supported,
        "Whether bfloat16 scores can run on AVX512-BF16's pair dot product in this build.");
  m.def("pair_dots_enabled", &pagecheck::pair_dots_enabled, "Whether bfloat16 scores run on the pair dot product now.");
  m.def("set_pair_dots", &pagecheck::set_pair_dots, "on"_a,
        "Switch the pair dot product of bfloat16 scores on or off (same bits either way).");
  m.def("transposed_pairs_enabled", &pagecheck::transposed_pairs_enabled,
        "Whether a prefill scores its transposed K blocks two at a time now.");
  m.def("set_transposed_pairs", &pagecheck::set_transposed_pairs, "on"_a,
        "Switch a prefill's transposed K blocks in pairs on or off (same bits either way; on raises ValueError "
        "in a build without AVX-512).");
  m.def("transposed_pairs_pay", &pagecheck::transposed_pairs_pay, "amd"_a, "family"_a,
        "For tests: whether the pairs are the default on a CPU of this vendor (AMD or not) and cpuid family.");
  m.def("wide_value_rows", &pagecheck::wide_value_rows,
        "For tests: query rows prefills' value passes weighed in full groups of 6 (rows whose keys start "
        "together, over the keys all of them see) since load.");
  m.def("prefill_block_starts", &pagecheck::prefill_block_starts, "L"_a,
        "For tests: where a prefill's query blocks start, in the order a KV head's blocks are handed out.");
  m.def("tile_walks_asking", &pagecheck::tile_walks_asking,
        "For tests: chunks the bfloat16 tile walk read asking for its next rows (K/V beyond 64 MiB) since load.");
  m.def("transposed_pairs_scored", &pagecheck::transposed_pairs_scored,
        "For tests: pairs of K blocks prefills scored together since load.");
  m.def("pair_dots_refusals", &pagecheck::pair_dots_refusals,
        "For tests: K blocks the pair dot product refused since load (a tiny element: scored by FMAs instead).");
  m.def(
      "output_cache_stats",
      [] {
        const pagecheck::OutputCacheStats s = pagecheck::output_cache_stats();
        nb::dict d;
        d["reused"] = s.reused;
        d["fresh"] = s.fresh;
        d["held"] = s.held;
        return d;
      },
      "Large outputs (32-512 MiB) given the buffer a dead output left (reused) or a new one (fresh), "
      "and the bytes kept now (held).");
  m.def("release_output_cache", &pagecheck::release_output_cache,
        "Frees the kept output buffer; returns its bytes (0 when none was kept).");
  m.def("fma_peak_gflops", &pagecheck::fma_peak_gflops, "seconds"_a = 0.3, nb::call_guard<nb::gil_scoped_release>(),
        "GFLOP/s of independent fused multiply-add chains on the kernels' threads (benchmark limit).");
  m.def("aligned_copy", &pagecheck::aligned_copy, "array"_a,
        "A row-contiguous copy of `array` (evaluated first) whose data starts on a 64-byte boundary "
        "(MLX's own large buffers start 24 bytes into one); ValueError for an array of no elements.");
  m.def("aligned_full", [](const std::vector<int>& shape, const mlx::core::array& value) {
          return pagecheck::aligned_full(mlx::core::Shape(shape.begin(), shape.end()), value);
        }, "shape"_a, "value"_a,
        "An array of `shape` and `value`'s dtype, every element `value` (one element), made in a buffer of "
        "its own whose data starts on a 64-byte boundary (no full-size array copied); ValueError for a shape "
        "of no elements or a value of more than one.");
  m.def(
      "huge_pages",
      [](mlx::core::array a) {
        a.eval();
        // Only a buffer the array fills: a broadcast or strided view's nbytes() is not
        // the size of the memory behind it.
        if (!a.flags().row_contiguous || a.data_size() != a.size()) return false;
        return pagecheck::huge_pages(a.data<void>(), a.nbytes(), /*now=*/true);
      },
      "array"_a,
      "Evaluates `array` and moves the 2 MiB-aligned interior of its buffer onto 2 MiB pages now "
      "(Linux madvise MADV_HUGEPAGE + MADV_COLLAPSE; values unchanged). Returns whether Linux took it.");
  const pagecheck::KernelInfo info = pagecheck::kernel_info();
  m.attr("CHUNK") = info.chunk;
  m.attr("LANES") = info.lanes;
  m.attr("DECODE_MAX_L") = info.decode_max_l;
  m.attr("FUSED_MULTIPLY_ADD") = info.fused_multiply_add;
  m.attr("AVX512") = info.avx512;
}
