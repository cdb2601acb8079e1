"""One prepared measurement run of the Triton paged attention on a GPU (made for an H200).

    python -m gpu.h200 --out DIR [--budget-s 420] [--only REGEX] [--no-flex]
    python -m gpu.h200 --out DIR --dry-run       # the same code path on the CPU (TRITON_INTERPRET=1), tiny shapes
    python -m gpu.h200 --memcheck-case           # a few small calls, for compute-sanitizer to wrap (gpu/h200.sh)

Writes DIR/h200.json and DIR/h200.md:

| section     | what |
|-------------|------|
| `device`    | name, SM count, memory, torch / triton / CUDA versions |
| `bandwidth` | a large device-to-device copy timed in this run: GB/s of bytes read + written (the denominator of every bandwidth fraction) and of bytes read |
| `rows`      | one per shape (Qwen3-4B: Hq 32, Hkv 8, D 128): decode L=1 at B 1/16, S 1K/8K/32K, page size 16/128, bf16/f16; prefill L=S 1K/8K at B=1 |
| `skipped`   | rows left out, with the reason (the budget, --only) |
| `goal`      | decode at S >= 8192 reads at least 80% of the measured copy bandwidth, row by row |

Each row times, with CUDA events around each call after an L2 flush, the median of many:
`ours` (gpu.paged.attention, the whole call: its checks' host read included), `ours_kernels`
(the call's kernel launches, `gpu.paged.plan`, replayed from a CUDA graph: the device time),
`sdpa` (torch SDPA, `enable_gqa`, on the K/V gathered to dense beforehand, untimed),
`sdpa_graph` (the same from a CUDA graph) and `flex` (FlexAttention + torch's PagedAttention
on the pool laid out heads-first beforehand, `torch.compile`d; "absent" when torch lacks it).
`ratio` is baseline time / ours (> 1: ours faster), eager against eager (`ratio`) and graph
against graph (`ratio_graph`). Bytes of a row: K and V of the context (B * S * Hkv * D * 2 *
itemsize) plus query and output; the bandwidth fraction is bytes / time / copy bandwidth.
Before any timing each path's output is checked against a float32 reference on the gathered
K/V (`error`): max abs error, and the error relative to each output row's largest value
against 8 * eps(dtype); a row whose kernel is wrong is reported WRONG, never as fast.

The budget (--budget-s, seconds since start): each row's time is estimated from the last row of
its kind (its time, plus its slowest call scaled by the work) and a row that would end past the
budget is skipped and listed. --dry-run: the CPU, the Triton interpreter, tiny shapes (Hq 4,
Hkv 2, D 16, S 64), time.perf_counter, eager FlexAttention, no CUDA graphs, no goal.

| module | job |
|---|---|
| `run` | the arguments, the rows in order within the budget, the report (`main`; `__main__` calls it) |
| `rows` | the shapes and the goal |
| `measure` | one row: every path checked, then timed; the device's facts; the copy bandwidth |
| `reference` | the cases (pools in a shuffled page order) and the float32 reference, the error rule |
| `baselines` | FlexAttention with torch's PagedAttention, torch SDPA |
| `clock` | the median per call (CUDA events, L2 flushed), CUDA graphs, the budget |
| `report` | a line a row, h200.json and h200.md |
| `memcheck` | compute-sanitizer's case |
| `backend` | torch and gpu.paged, imported with TRITON_INTERPRET set where needed |
"""
