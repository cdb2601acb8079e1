"""Compile the Triton kernels' variants for Hopper (sm_90a) without a GPU, and check their resources.

    TRITON_INTERPRET=0 python -m gpu.compile [--json PATH] [--ptx-dir DIR] [--jobs N] [--quick]

Under `TRITON_INTERPRET=1` `@triton.jit` yields interpreter functions that cannot be compiled,
and gpu/__init__.py sets it where torch sees no GPU (unless the environment says): so pass
`TRITON_INTERPRET=0` (`main` also forces 0 while gpu.kernels is not imported yet). The
imported kernels being interpreter functions is an error, not a skip. `TRITON_DEBUG=1`
compiles the debug variants (device asserts on), as a debug run would.

| what                | how |
|---------------------|-----|
| compiled            | the launches `gpu.paged.plan` builds for a set of calls (`CALLS`: 46 distinct launches after deduplication; `--quick`, the test's set: 33): decode (L=1 and L=8, GQA group 4) + merge, and prefill (L=512); float16, bfloat16, float32 queries; head dims 64, 128, 256 and Dk=192/Dv=128 (MLA-like); page size 16 (per-key page gather) and 128 (page tiles); score pipelines plain causal, sliding window, softcap+ALiBi+sinks+lse, no mask. Qwen3-4B heads: Hq 32, Hkv 8. Together they take every constexpr branch of gpu/kernels.py a GPU can reach (`DOT_F32` is the interpreter's alone: off on a GPU) |
| how                 | `triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32), options=dict(num_warps, num_stages, debug))`; the signature, constexprs and divisibility attrs are the ones `JITFunction.run` derives from the same arguments (triton's own `native_specialize_impl`: ints equal to 1 become constexprs, 16-divisible pointers and ints get `tt.divisibility`), so each variant is the binary a call on an H200 would build |
| recorded, per variant | kernel, description, registers per thread, spill stores / loads (bytes), stack frame and local bytes, shared memory (triton's metadata `shared`: the dynamic shared memory the launch asks for; cuobjdump's static SHARED apart: on sm_90 the 1 KiB reserved per block), num_warps, num_stages, the tile constexprs, compile seconds (`triton.compile`, cache bypassed) |
| registers, spills   | `cuobjdump -res-usage` on triton's cubin (REG, STACK, LOCAL) and `ptxas -v --gpu-name=sm_90a -lineinfo` on its PTX (the flags triton uses) for the spill bytes, both triton's bundled tools, their output read by gpu/ptxas.py |
| failure (exit 1)    | a compile error; any spill (spilled registers go to local memory, off-chip: a kernel whose inner loop spills runs at a fraction of its speed; the fix is a smaller tile in `gpu.paged.Schedule`, found with `compile_all(calls, schedule=...)`); dynamic shared memory over Hopper's 227 KiB per block (the most a block can opt into, the reserved 1 KiB apart: the launch would fail with "out of resources"); registers over 255 |

`--ptx-dir DIR` keeps each variant's `.ptx`, `.cubin`, `.ptxas.log` and `.json` (signature,
constexprs, metadata: what loading the cubin on a device needs).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

from gpu.ptxas import parse_ptxas, parse_res_usage, tool

ARCH = 90  # Hopper (H100/H200)
GPU_NAME = "sm_90a"  # what triton's ptxas call targets for capability 90
MAX_REGISTERS = 255
MAX_SHARED = 227 * 1024  # Hopper: the most dynamic shared memory one block can opt into

# --- the variants -------------------------------------------------------------------------
HQ, HKV = 32, 8  # Qwen3-4B: GQA group 4
CONTEXT = 4096  # keys per request: a decode cut into the most splits (16)
PREFILL_L = 512  # a prefill's query rows (> Schedule.decode_rows)
DTYPES = ("float16", "bfloat16", "float32")
PIPELINES = {  # name -> plan() options
    "causal": dict(mask="causal"),
    "window": dict(mask="causal", window=128),
    "full": dict(mask="causal", softcap=30.0, alibi=True, sinks=True, return_lse=True),
    "nomask": dict(mask=None),
}


@dataclass(frozen=True)
class Call:
    """One call of `paged_attention` (its launches are what gets compiled)."""

    L: int
    dtype: str
    dk: int
    dv: int
    page_size: int
    pipeline: str

    @property
    def label(self) -> str:
        kind = f"decode L={self.L}" if self.L <= 8 else f"prefill L={self.L}"
        d = str(self.dk) if self.dk == self.dv else f"{self.dk}/{self.dv}"
        return f"{kind} {self.dtype} D={d} ps={self.page_size} {self.pipeline}"


def _calls(quick: bool = False) -> list[Call]:
    """The calls compiled: not the cross product, a set that takes every branch.

    Base grid: every dtype x head dim 64/128/256, decode L=1 at page size 16 (per-key gather)
    and prefill at page size 128 (page tiles), plain causal. Then each pipeline flag on
    both schedules, both page sizes, the L=8 decode (BLOCK_M 32, BLOCK_L 8) and the MLA
    shape. `quick` keeps one head dim per dtype in the base grid (the test's budget)."""
    calls = []
    base_dims = (128,) if quick else (64, 128, 256)
    for dt in DTYPES:
        for d in base_dims:
            calls.append(Call(1, dt, d, d, 16, "causal"))
            calls.append(Call(PREFILL_L, dt, d, d, 128, "causal"))
    if quick:
        calls += [Call(1, "float16", 256, 256, 16, "causal"), Call(PREFILL_L, "bfloat16", 64, 64, 128, "causal")]
    # L=8 decode: the whole group's 32 rows in one tile
    calls += [Call(8, dt, 128, 128, 128, "window") for dt in DTYPES]
    calls += [
        # softcap + ALiBi + sinks + lse
        Call(1, "bfloat16", 128, 128, 16, "full"),
        Call(8, "float16", 128, 128, 128, "full"),
        Call(PREFILL_L, "bfloat16", 128, 128, 16, "full"),
        Call(PREFILL_L, "float32", 256, 256, 128, "full"),
        # window
        Call(1, "float16", 256, 256, 16, "window"),
        Call(PREFILL_L, "float16", 128, 128, 16, "window"),
        # no mask
        Call(1, "float32", 64, 64, 128, "nomask"),
        Call(PREFILL_L, "bfloat16", 128, 128, 16, "nomask"),
        # MLA-like: Dk 192 (BLOCK_DK 256, masked), Dv 128
        Call(1, "bfloat16", 192, 128, 16, "full"),
        Call(8, "bfloat16", 192, 128, 128, "causal"),
        Call(PREFILL_L, "bfloat16", 192, 128, 128, "causal"),
    ]
    if quick:
        calls += [Call(PREFILL_L, "float16", 256, 256, 16, "window")]
    return calls


CALLS = _calls()


def plan_call(call: Call, schedule=None):
    """`gpu.paged.plan` on small CPU tensors of the call's shapes: its launches (under
    `schedule`, a `gpu.paged.Schedule`; its default when None)."""
    import torch

    from gpu import paged

    dtype = getattr(torch, call.dtype)
    B, P = 2, 4  # P pages in the pool (not 1: an int 1 is a constexpr to triton)
    width = CONTEXT // call.page_size
    q = torch.empty((B, HQ, call.L, call.dk), dtype=dtype)
    kp = torch.empty((P, HKV, call.page_size, call.dk), dtype=dtype)
    vp = torch.empty((P, HKV, call.page_size, call.dv), dtype=dtype)
    bt = torch.zeros((B, width), dtype=torch.int32)
    ctx = torch.full((B,), CONTEXT, dtype=torch.int32)
    opts = dict(PIPELINES[call.pipeline])
    alibi, sinks = opts.pop("alibi", False), opts.pop("sinks", False)
    _, _, launches = paged.plan(q, kp, vp, bt, ctx, scale=call.dk ** -0.5,
                                alibi_slopes=torch.full((HQ,), -0.0625) if alibi else None,
                                sinks=torch.zeros(HQ) if sinks else None,
                                schedule=paged.DEFAULT if schedule is None else schedule, **opts)
    return launches


def specialize(launch):
    """(signature, constexprs, attrs) as `JITFunction.run` derives them for a CUDA device."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    backend = make_backend(GPUTarget("cuda", ARCH, 32))
    fn = launch.kernel
    missing = set(fn.arg_names) - set(launch.args) - set(launch.meta)
    if missing:
        raise TypeError(f"{fn.__name__}: no value for {sorted(missing)}")
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in launch.meta:
            signature[name] = "constexpr"
            constexprs[name] = launch.meta[name]
            continue
        ty, spec = native_specialize_impl(type(backend), launch.args[name], False, True, True)
        signature[name] = ty
        if ty == "constexpr":  # an int equal to 1 (or None, a bool constexpr)
            constexprs[name] = spec
        elif isinstance(spec, str) and spec:
            attrs[(i,)] = backend.parse_attr(spec)
    return signature, constexprs, attrs


def variant_key(launch) -> str:
    signature, constexprs, attrs = specialize(launch)
    return json.dumps([launch.kernel.__name__, signature, {k: repr(v) for k, v in constexprs.items()},
                       sorted(str(k) for k in attrs), launch.num_warps, launch.num_stages], sort_keys=True)


# --- compiling --------------------------------------------------------------------------
@dataclass
class Row:
    kernel: str
    variant: str
    dtype: str
    registers: int = -1
    spill_stores: int = -1
    spill_loads: int = -1
    stack_bytes: int = -1
    local_bytes: int = -1
    shared_bytes: int = -1  # triton's metadata "shared": the dynamic shared memory the launch asks for
    static_shared_bytes: int = -1  # cuobjdump's SHARED (sm_90: the 1 KiB reserved per block, if any shared is used)
    num_warps: int = 0
    num_stages: int = 0
    compile_s: float = 0.0
    meta: dict = field(default_factory=dict)  # the tile constexprs (BLOCK_*, PAGE_TILES, ...)
    also: list = field(default_factory=list)  # other calls that reach the same binary
    error: str = ""

    def problems(self) -> list[str]:
        out = []
        if self.error:
            out.append(f"compile error: {self.error}")
            return out
        if self.spill_stores or self.spill_loads:
            out.append(f"spills {self.spill_stores} B stored / {self.spill_loads} B loaded")
        if not 0 < self.registers <= MAX_REGISTERS:
            out.append(f"{self.registers} registers")
        if self.shared_bytes > MAX_SHARED:
            out.append(f"{self.shared_bytes} B shared > {MAX_SHARED}")
        return out


_TILE_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_L", "BLOCK_DK", "BLOCK_DV", "NS", "PAGE_TILES", "CAUSAL", "HAS_WINDOW",
              "HAS_SOFTCAP", "HAS_ALIBI", "HAS_SINKS", "WRITE_LSE", "DOT_F32")


def compile_launch(launch, label: str, keep_dir: str | None = None, stem: str = "") -> Row:
    """Compile one launch for sm_90a; its resources from cuobjdump and ptxas."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource

    fn = launch.kernel
    if not isinstance(fn, triton.runtime.jit.JITFunction):  # the interpreter's InterpretedFunction
        raise RuntimeError("the kernels were built by Triton's interpreter (TRITON_INTERPRET=1): run with "
                           "TRITON_INTERPRET=0 in a fresh process")
    name = fn.__name__
    dtype = str(launch.args.get("Q", launch.args.get("O")).dtype).replace("torch.", "")
    row = Row(name, label, dtype, num_warps=launch.num_warps, num_stages=launch.num_stages,
              meta={k: launch.meta[k] for k in _TILE_KEYS if k in launch.meta})
    signature, constexprs, attrs = specialize(launch)
    # the options JITFunction.run passes (debug: the kernel's own flag or TRITON_DEBUG)
    options = dict(num_warps=launch.num_warps, num_stages=launch.num_stages,
                   debug=bool(fn.debug or triton.knobs.runtime.debug))
    t0 = time.perf_counter()
    try:
        kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                                target=GPUTarget("cuda", ARCH, 32), options=options)
    except Exception as e:  # noqa: BLE001 - any compiler failure is a row's error
        row.compile_s = round(time.perf_counter() - t0, 2)
        row.error = error_text(e)
        return row
    row.compile_s = round(time.perf_counter() - t0, 2)
    row.shared_bytes = int(kernel.metadata.shared)
    ptx, cubin = kernel.asm["ptx"], kernel.asm["cubin"]
    entry = kernel.metadata.name
    with tempfile.TemporaryDirectory() as tmp:
        base = os.path.join(keep_dir or tmp, stem or entry)
        with open(base + ".ptx", "w") as f:
            f.write(ptx)
        with open(base + ".cubin", "wb") as f:
            f.write(cubin)
        res = subprocess.run([tool("cuobjdump"), "-res-usage", base + ".cubin"], capture_output=True, text=True)
        usage = parse_res_usage(res.stdout).get(entry, {})
        # the flags of triton's own ptxas call (backends/nvidia/compiler.py make_cubin)
        fmad = [] if kernel.metadata.enable_fp_fusion else ["--fmad=false"]
        pt = subprocess.run([tool("ptxas"), "-lineinfo", *fmad, "-v", f"--gpu-name={GPU_NAME}", base + ".ptx",
                             "-o", os.path.join(tmp, "ptxas.o")], capture_output=True, text=True)
        log = pt.stdout + pt.stderr
        info = parse_ptxas(log).get(entry, {})
        if keep_dir:
            with open(base + ".ptxas.log", "w") as f:
                f.write(log)
            with open(base + ".json", "w") as f:
                json.dump(dict(name=entry, variant=label, signature=signature,
                               constexprs={k: (v if isinstance(v, (int, float, bool, str)) or v is None else repr(v))
                                           for k, v in constexprs.items()},
                               attrs={str(k): v for k, v in attrs.items()}, grid_example=list(launch.grid),
                               options=options,
                               shared=row.shared_bytes, cuobjdump=usage, ptxas=info), f, indent=1)
    if pt.returncode != 0 or not info or not usage:
        row.error = (f"resource usage unreadable (cuobjdump rc {res.returncode}, ptxas rc {pt.returncode}): "
                     f"{(res.stderr + pt.stderr).strip()[:200]}")
        return row
    row.registers = usage.get("REG", info.get("registers", -1))
    row.stack_bytes = usage.get("STACK", info.get("stack", -1))
    row.local_bytes = usage.get("LOCAL", 0)
    row.static_shared_bytes = usage.get("SHARED", 0)
    row.spill_stores, row.spill_loads = info.get("spill_stores", -1), info.get("spill_loads", -1)
    if info.get("registers") not in (None, row.registers):
        row.error = f"ptxas -v says {info['registers']} registers, the cubin {row.registers}: not triton's flags?"
    return row


def error_text(e: BaseException) -> str:
    """A compiler exception in one line: the @jit functions it passed through (with the line,
    counted from each one's `def`) and the innermost message."""
    where, inner, seen = [], e, set()
    while inner is not None and id(inner) not in seen:
        seen.add(id(inner))
        src, node = getattr(inner, "src", None), getattr(inner, "node", None)
        if isinstance(src, str) and src.lstrip().startswith("def ") and hasattr(node, "lineno"):
            where.append(f"{src.lstrip()[4:].split('(')[0]}:{node.lineno}")
        nxt = inner.__cause__ or inner.__context__
        if nxt is None:
            break
        inner = nxt
    msg = getattr(inner, "error_message", None) or str(inner)
    lines = [ln.strip() for ln in str(msg).strip().splitlines() if ln.strip()]
    sentences = re.split(r"(?<=\.)\s+", " / ".join(lines[:3]))
    text = f"{type(inner).__name__}: {' '.join(sentences[:2])}"
    return (f"{' -> '.join(where)}: " if where else "") + text[:300]


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_")


def _work(item):
    """Worker: (call, schedule, launch index, description, keep_dir, stem) -> Row (launches
    rebuilt here: a JIT kernel does not pickle)."""
    call, schedule, index, label, keep_dir, stem = item
    return compile_launch(plan_call(call, schedule)[index], label, keep_dir, stem)


def _init_worker():
    os.environ["TRITON_INTERPRET"] = "0"
    from triton import knobs

    knobs.compilation.always_compile = True


def compile_all(calls=None, *, schedule=None, keep_dir: str | None = None, jobs: int = 1,
                progress=None) -> list[Row]:
    """Plan every call (under `schedule`: a `gpu.paged.Schedule`, picklable for `jobs` > 1),
    keep one launch per distinct binary, compile those for sm_90a."""
    from triton import knobs

    knobs.compilation.always_compile = True  # honest compile seconds: no cache hits
    calls = CALLS if calls is None else calls
    unique: dict = {}
    for call in calls:
        for i, launch in enumerate(plan_call(call, schedule)):
            key = variant_key(launch)
            if key in unique:
                unique[key][4].append(call.label)
            else:
                unique[key] = [call, i, call.label, launch.kernel.__name__, []]
    items = []
    for n, (call, i, label, kname, _) in enumerate(unique.values()):
        items.append((call, schedule, i, label, keep_dir, f"{n:02d}_{kname}_{_slug(label)}"))
    if keep_dir:
        os.makedirs(keep_dir, exist_ok=True)
    if jobs > 1:
        import multiprocessing as mp

        with mp.get_context("spawn").Pool(jobs, initializer=_init_worker) as pool:
            rows = []
            for row in pool.imap(_work, items):
                rows.append(row)
                progress and progress(row)
    else:
        rows = []
        for item in items:
            rows.append(_work(item))
            progress and progress(rows[-1])
    for row, entry in zip(rows, unique.values()):
        row.also = entry[4]
    return rows


def table(rows: list[Row]) -> str:
    head = ("| # | kernel | variant | regs | spill st/ld B | stack B | shared B | warps | stages | tiles | s | status |\n"
            "|---|--------|---------|------|---------------|---------|----------|-------|--------|-------|---|--------|")
    lines = [head]
    for n, r in enumerate(rows):
        m = r.meta
        tiles = "x".join(str(m[k]) for k in ("BLOCK_M", "BLOCK_L", "BLOCK_N", "BLOCK_DK", "BLOCK_DV") if k in m)
        if m.get("PAGE_TILES"):
            tiles += " pt"
        status = "; ".join(r.problems()) or "ok"
        lines.append(f"| {n} | {r.kernel} | {r.variant}{f' (+{len(r.also)})' if r.also else ''} | {r.registers} | "
                     f"{r.spill_stores}/{r.spill_loads} | {r.stack_bytes} | {r.shared_bytes} | {r.num_warps} | "
                     f"{r.num_stages} | {tiles} | {r.compile_s} | {status} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gpu.compile", description=__doc__.split("\n")[0])
    ap.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    ap.add_argument("--ptx-dir", metavar="DIR", help="keep each variant's .ptx, .cubin, .ptxas.log, .json")
    ap.add_argument("--jobs", "-j", type=int, default=1, help="compile in N processes (default 1)")
    ap.add_argument("--quick", action="store_true", help="one head dim per dtype in the base grid (fewer variants)")
    args = ap.parse_args(argv)
    if "gpu.kernels" not in sys.modules:  # read when the kernels are decorated: not yet
        os.environ["TRITON_INTERPRET"] = "0"
    t0 = time.perf_counter()
    rows = compile_all(_calls(args.quick), keep_dir=args.ptx_dir, jobs=args.jobs,
                       progress=lambda r: print(f"  {r.kernel:20s} {r.variant:48s} {r.registers:4d} regs "
                                                f"{r.compile_s:5.2f} s", file=sys.stderr, flush=True))
    print(table(rows))
    failed = [(r, p) for r in rows if (p := r.problems())]
    print(f"\n{len(rows)} variants compiled for {GPU_NAME} in {time.perf_counter() - t0:.1f} s; "
          f"{len(failed)} failed")
    for r, p in failed:
        print(f"FAIL {r.kernel} [{r.variant}]: {'; '.join(p)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
