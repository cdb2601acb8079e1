// What the Python binding needs to know of the kernels, without their headers: the
// binding (nanobind and MLX's headers, about 10 s to compile) then rebuilds only when
// this file changes, not for every change of kernel.h, blocks.h or numerics.h (each
// seeded mutant of those is one rebuild of the kernels: mutants/runner.py).
#pragma once

#include <cstdint>
#include <vector>

namespace pagecheck {

struct KernelInfo {
  int chunk;             // keys per chunk (numerics.h kChunk)
  int lanes;             // lanes of the score dot product (kLanes)
  int decode_max_l;      // longest query of the decode schedule (kernel.h kDecodeMaxL)
  bool fused_multiply_add;  // numerics.h fmadd rounds once
  bool avx512;            // built with AVX-512F: the 16-lane loops run on zmm registers, not
                          // their AVX2 / scalar twins (-march=native: where the CPU has it)
};
KernelInfo kernel_info();

// Built with the tile path, the CPU has AMX-BF16 and Linux lets this process use the
// tile registers (asked once: arch_prctl ARCH_REQ_XCOMP_PERM).
bool amx_supported();
// Whether bfloat16 calls use the tiles now (amx_supported and not switched off).
bool amx_enabled();
// Switches the tile path on or off for later calls; on throws std::invalid_argument
// where amx_supported() is false.
void set_amx(bool on);

// Built with AVX512-BF16 (pair_dots.h): bfloat16 scores can run on vdpbf16ps, with the
// same bits as the FMA loop.
bool pair_dots_supported();
// Whether they do now: supported, and $PAGECHECK_PAIR_DOTS (0 or 1) at load time, else
// on where it pays (AMD CPUs: pair_dots.h).
bool pair_dots_enabled();
// Switches them on or off for later calls; on throws std::invalid_argument where
// pair_dots_supported() is false.
void set_pair_dots(bool on);
// K blocks the pair dot product refused since the module was loaded (a tiny element:
// scored by the FMA loop instead), for tests.
int64_t pair_dots_refusals();

// Whether a prefill scores its transposed K blocks two at a time (transposed.h
// scores_transposed, transposed_walk.h): $PAGECHECK_TRANSPOSED_PAIRS (0 or 1) at load
// time, else on where it pays (transposed_pairs_pay for this CPU's vendor and cpuid
// family); false in a build without AVX-512, which has no transposed walk.
bool transposed_pairs_enabled();
// Whether the pairs are faster on a CPU of this vendor (AMD or not) and cpuid display
// family: everywhere but AMD's Zen 4 and older (transposed_pairs.cpp says why).
bool transposed_pairs_pay(bool amd, int family);
// Switches the pairs on or off for later calls (the same bits either way); on throws
// std::invalid_argument in a build without AVX-512.
void set_transposed_pairs(bool on);
// For tests: pairs of K blocks prefills scored together since the module was loaded (per
// head and row selection, as counted by count_transposed_pairs).
int64_t transposed_pairs_scored();
void count_transposed_pairs(int64_t pairs);
// For tests: chunks the bfloat16 tile walk (amx.cpp) read asking for its next rows (a
// call whose K/V exceed 64 MiB: kTileAskKvBytes, amx.cpp) since the module was loaded.
int64_t tile_walks_asking();
// For tests: query rows a prefill's value passes weighed in full groups of kWeighRows
// (weigh_by_group: rows whose keys of a chunk start together, over the keys all of them
// see) since the module was loaded.
int64_t wide_value_rows();
void count_wide_value_rows(int64_t rows);
// The first query position of each block of a prefill (prefill.cpp), in the order one KV
// head's blocks are handed to the threads.
std::vector<int> prefill_block_starts(int L);

// KV heads per work item of the decode schedule (decode.cpp) for `chunk_items` (request,
// chunk) pairs whose chunks hold `item_keys` keys each on average, L query positions, on
// the current worker count.
int decode_heads_per_item(int64_t chunk_items, int Hkv, int64_t item_keys, int L);

// Keys of a decode's value spans (value_pass.h value_span) for V rows of `value_row_bytes`
// bytes in a call whose requests hold `kv_bytes` bytes of K and V.
int decode_value_span(int64_t value_row_bytes, int64_t kv_bytes);

// Whether a decode's value pass asks for the V rows it weighs next (value_pass.h value_asks),
// for V elements of `element_bytes` (1, 2 or 4) in a call whose requests hold `kv_bytes`.
bool decode_value_asks(int64_t element_bytes, int64_t kv_bytes);

// Whether a decode keeps its chunk states (`floats` of them, o's and ml's) in the calling
// thread's buffers from call to call (decode.cpp kKeptStateFloats), rather than its own.
bool decode_keeps_states(int64_t floats);

// The calling thread's kept chunk-state buffers, in floats: {ml's, o's}.
std::vector<int64_t> decode_kept_state_floats();

// Whether a bfloat16 call whose KV heads have `rows_per_head` query rows each, of head dim
// D, scores them on the pair dot product now (chunk.h pairs_apply).
bool pair_dots_apply(int rows_per_head, int D);

}  // namespace pagecheck
