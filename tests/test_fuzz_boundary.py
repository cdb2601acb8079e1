"""Fuzzing the boundary between the contract checks and the compiled kernel.

Hypothesis draws whole calls with random metadata: page ids in and out of the pool
(extremes of int32 included), context lengths that are valid, empty, negative, shorter
than L, past the table or huge, tables of 0..6 columns, pools of 0..8 pages, and now and
then one shape / dtype / option corruption (wrong rank, dtype, rows, heads, page size,
scale, mask, window, KV format or scale) or a strided (non-contiguous) query or table;
one call in three reads quantized pages (fp8 or int8 codes with tensor, head or token
scales; unwritten slots hold NaN codes and NaN token scales). Every call must

* through `impl.paged_attention`: raise `ContractViolation` with the clause the contract
  names for the first thing wrong (shapes, then options, then requests in order), or
  return a finite result that passes the tolerance rule against the float64 oracle
  (oracles.compare);
* through the unvalidated entry point `pagecheck_kernels.paged_attention` (same arrays):
  raise ValueError for what the C++ layer checks (ranks, shapes, dtypes, heads, page
  size, negative window, non-finite scale), else return with every request it cannot
  compute safely all NaN and every other request bit for bit what the validated operator
  gives for the batch with the unsafe requests emptied (batch invariance).

Nothing may crash, and under `python -m sanitize fuzz --seconds N` (ASan + UBSan) nothing
may read or write outside a buffer. Plain pytest runs EXAMPLES derandomized examples (a
few seconds); with PAGECHECK_FUZZ_SECONDS=N it runs rounds of fresh random examples until
N seconds have passed (seeds from PAGECHECK_FUZZ_SEED, default random, printed).
"""

from __future__ import annotations

import collections
import math
import os
import random
import time
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

import impl
import pagecheck_kernels
from fixtures import DTYPES, bits
from fixtures.quantized import quantize_pages
from oracles.compare import compare

pytestmark = [pytest.mark.correctness, pytest.mark.builtin_only("the built-in validation's clause ids and its unvalidated compiled entry point")]

EXAMPLES = 150
FUZZ_SECONDS = float(os.environ.get("PAGECHECK_FUZZ_SECONDS", "0") or 0)
INT32_MIN, INT32_MAX = -2 ** 31, 2 ** 31 - 1

# name -> (clause impl must raise, whether the C++ entry point rejects it too)
CORRUPTIONS = {
    "query-rank": ("rank", True),
    "table-rank": ("rank", True),
    "lens-rank": ("rank", True),
    "query-int32": ("dtype", True),
    "keys-dtype": ("dtype", True),
    "values-dtype": ("dtype", True),
    "table-int64": ("metadata_dtype", True),
    "table-float32": ("metadata_dtype", True),
    "lens-uint32": ("metadata_dtype", True),
    "values-shape": ("value_shape", True),
    "head-dim": ("shape", True),
    "table-rows": ("shape", True),
    "lens-rows": ("shape", True),
    "heads": ("heads", True),
    "page-size-pool": ("page_size", True),
    "page-size-zero": ("page_size", True),
    "scale-nan": ("scale", True),
    "scale-inf": ("scale", True),
    "mask": ("mask", False),
    "window-zero": ("window", False),  # C++: window 0 means "no window"
    "window-negative": ("window", True),
    "window-unmasked": ("window", False),  # C++: causal=false ignores the window
    # quantized pages only (Spec.kv set)
    "kv-dtype-unknown": ("kv_dtype", False),  # no code to hand the C++ entry point
    "kv-pages-float": ("kv_dtype", True),
    "kv-scale-shape": ("kv_scale", True),
    "kv-scale-zero": ("kv_scale", False),  # C++ does not read scale values
}
KV_CORRUPTIONS = tuple(c for c in CORRUPTIONS if c.startswith("kv-"))
KV_CODES = {None: 0, "float8_e4m3fn": 1, "float8_e5m2": 2, "int8": 3}


@dataclass(frozen=True)
class Spec:
    """One drawn call, as plain values (this is what a failing example prints)."""

    L: int
    page_size: int
    kv_heads: int
    group: int
    head_dim: int
    num_pages: int
    dtype: str
    context_lens: tuple[int, ...]
    table: tuple[tuple[int, ...], ...]  # [B][max_pages]
    causal: bool
    window: int | None
    scale: float | None
    corruption: str | None
    strided: str | None  # None, "query" or "table"
    seed: int
    kv: tuple[str, str] | None = None  # (kv_dtype, granularity) of quantized pages

    @property
    def max_pages(self) -> int:
        return len(self.table[0])


@st.composite
def contexts(draw, L: int, capacity: int, clean: bool) -> int:
    """capacity: positions the table can hold (max_pages * page_size)."""
    if clean:
        kind = draw(st.sampled_from(["valid"] * 4 + ["empty"]))
    else:
        kind = draw(st.sampled_from(["valid"] * 5 + ["empty", "negative", "short", "past", "extreme"]))
    if kind == "valid":
        return draw(st.integers(L, max(L, capacity)))
    if kind == "empty":
        return 0
    if kind == "negative":
        return draw(st.one_of(st.integers(-5, -1), st.just(INT32_MIN)))
    if kind == "short":
        return draw(st.integers(1, L - 1)) if L > 1 else 0
    if kind == "past":
        return max(L, capacity + draw(st.integers(1, 20)))
    return draw(st.sampled_from([INT32_MAX, INT32_MAX - 1, 2 ** 30]))


@st.composite
def page_ids(draw, P: int, clean: bool) -> int:
    kind = "valid" if clean else draw(st.sampled_from(["valid"] * 8 + ["high", "negative", "extreme"]))
    if kind == "valid" and P > 0:
        return draw(st.integers(0, P - 1))
    if kind == "negative":
        return draw(st.integers(-3, -1))
    if kind == "extreme":
        return draw(st.sampled_from([INT32_MIN, INT32_MAX, 2 ** 24]))
    return draw(st.integers(P, P + 3))


@st.composite
def specs(draw) -> Spec:
    # One call in three is clean (every request valid or empty, no corruption), so the
    # computed side gets its share; the others mix bad values freely.
    clean = draw(st.sampled_from([False, False, True]))
    corruption = None if clean else draw(st.one_of(st.none(), st.sampled_from(sorted(CORRUPTIONS))))
    L = draw(st.sampled_from([1, 2, 3, 8, 9, 17]))
    page_size = draw(st.sampled_from([1, 2, 3, 4, 5, 8, 16]))
    kv_heads = draw(st.integers(1, 2)) if corruption != "heads" else 2
    B = draw(st.integers(1, 4))
    P = draw(st.integers(1 if clean else 0, 8))
    least = -(-L // page_size)  # pages of a request holding just its L positions
    max_pages = draw(st.integers(least, least + 4) if clean else st.integers(0, 6))
    lens = tuple(draw(contexts(L, max_pages * page_size, clean)) for _ in range(B))
    table = tuple(tuple(draw(page_ids(P, clean)) for _ in range(max_pages)) for _ in range(B))
    causal = draw(st.booleans())
    window = draw(st.one_of(st.none(), st.integers(1, 40), st.just(INT32_MAX))) if causal else None
    kv = None
    if P > 0 and (corruption in KV_CORRUPTIONS or draw(st.sampled_from([False, False, True]))):
        kv = (draw(st.sampled_from(["float8_e4m3fn", "float8_e5m2", "int8"])),
              draw(st.sampled_from(["tensor", "head", "token"])))
    elif corruption in KV_CORRUPTIONS:
        corruption = None  # no page to quantize
    return Spec(kv=kv, L=L, page_size=page_size, kv_heads=kv_heads, group=draw(st.integers(1, 3)),
                head_dim=draw(st.sampled_from([1, 3, 8, 16, 24, 32])), num_pages=P,
                dtype=draw(st.sampled_from(sorted(DTYPES))), context_lens=lens, table=table, causal=causal,
                window=window, scale=draw(st.one_of(st.none(), st.floats(-2.0, 2.0, allow_nan=False))),
                corruption=corruption, strided=draw(st.sampled_from([None, None, "query", "table"])),
                seed=draw(st.integers(0, 2 ** 32 - 1)))


def _safe(spec: Spec, b: int) -> bool:
    """The contract's per-request rules, restated: whether request b may be computed."""
    ctx, ps = spec.context_lens[b], spec.page_size
    if ctx < 0 or 0 < ctx < spec.L:
        return False
    pages = -(-ctx // ps)
    return pages <= spec.max_pages and all(0 <= p < spec.num_pages for p in spec.table[b][:pages])


def expected_clause(spec: Spec) -> str | None:
    """The clause of the first rule broken: shapes and options first, then requests in order."""
    if spec.corruption in ("keys-dtype", "values-dtype") and spec.kv:
        return "kv_dtype"  # float pages where codes were declared
    if spec.corruption:
        return CORRUPTIONS[spec.corruption][0]
    for b, ctx in enumerate(spec.context_lens):
        if ctx < 0:
            return "context_negative"
        if 0 < ctx < spec.L:
            return "context_short"
        pages = -(-ctx // spec.page_size)
        if pages > spec.max_pages:
            return "table_short"
        if not _safe(spec, b):
            return "page_id"
    return None


@dataclass
class Call:
    args: list  # query, key_pages, value_pages, block_table, context_lens, page_size
    kwargs: dict  # scale, mask, window


def build(spec: Spec) -> Call:
    """Arrays of the call: NaN everywhere except the slots some request may read."""
    rng = np.random.default_rng(spec.seed)
    B, ps, Hkv, D, P = len(spec.context_lens), spec.page_size, spec.kv_heads, spec.head_dim, spec.num_pages
    Hq = Hkv * spec.group
    kp = np.full((P, Hkv, ps, D), np.nan, dtype=np.float32)
    vp = np.full((P, Hkv, ps, D), np.nan, dtype=np.float32)
    for b, ctx in enumerate(spec.context_lens):
        for j in range(max(0, min(ctx, spec.max_pages * ps))):
            page = spec.table[b][j // ps]
            if 0 <= page < P:
                kp[page, :, j % ps] = rng.standard_normal((Hkv, D))
                vp[page, :, j % ps] = rng.standard_normal((Hkv, D))
    q = rng.standard_normal((B, Hq, spec.L, D)).astype(np.float32)
    table = np.array(spec.table, dtype=np.int32).reshape(B, spec.max_pages)
    lens = np.array(spec.context_lens, dtype=np.int32)
    dt = DTYPES[spec.dtype]
    query = mx.array(q).astype(dt)
    block_table = mx.array(table)
    if spec.strided == "query":  # a transposed view: not row-contiguous
        query = mx.swapaxes(mx.array(np.ascontiguousarray(q.swapaxes(1, 2))).astype(dt), 1, 2)
    elif spec.strided == "table":
        block_table = mx.array(np.ascontiguousarray(table.T)).T
    call = Call([query, mx.array(kp).astype(dt), mx.array(vp).astype(dt), block_table, mx.array(lens), ps],
                {"scale": spec.scale, "mask": "causal" if spec.causal else None, "window": spec.window})
    mx.eval(call.args[:5])
    if spec.kv:
        call = _quantize(spec, call)
    return _corrupt(spec, call) if spec.corruption else call


def _quantize(spec: Spec, call: Call) -> Call:
    """The pools as codes of spec.kv's format and granularity (fixtures.quantized)."""
    kv_dtype, granularity = spec.kv
    kp, k_scale = quantize_pages(call.args[1], kv_dtype, granularity)
    vp, v_scale = quantize_pages(call.args[2], kv_dtype, granularity)
    mx.eval(kp, vp, k_scale, v_scale)
    return Call([call.args[0], kp, vp, *call.args[3:]],
                {**call.kwargs, "kv_dtype": kv_dtype, "k_scale": k_scale, "v_scale": v_scale})


def _corrupt(spec: Spec, call: Call) -> Call:
    q, kp, vp, bt, cl, ps = call.args
    kw = dict(call.kwargs)
    other = mx.float16 if q.dtype != mx.float16 else mx.float32
    c = spec.corruption
    changes = {
        "query-rank": lambda: [q[0], kp, vp, bt, cl, ps],
        "table-rank": lambda: [q, kp, vp, bt.reshape(-1), cl, ps],
        "lens-rank": lambda: [q, kp, vp, bt, cl[None], ps],
        "query-int32": lambda: [q.astype(mx.int32), kp, vp, bt, cl, ps],
        "keys-dtype": lambda: [q, kp.astype(other), vp, bt, cl, ps],
        "values-dtype": lambda: [q, kp, vp.astype(other), bt, cl, ps],
        "table-int64": lambda: [q, kp, vp, bt.astype(mx.int64), cl, ps],
        "table-float32": lambda: [q, kp, vp, bt.astype(mx.float32), cl, ps],
        "lens-uint32": lambda: [q, kp, vp, bt, cl.astype(mx.uint32), ps],
        "values-shape": lambda: [q, kp, mx.concatenate([vp, vp[:1]]) if vp.shape[0] else vp[:, :, :, :0], bt, cl, ps],
        "head-dim": lambda: [mx.concatenate([q, q[..., :1]], axis=-1), kp, vp, bt, cl, ps],
        "table-rows": lambda: [q, kp, vp, mx.concatenate([bt, bt[:1]]), cl, ps],
        "lens-rows": lambda: [q, kp, vp, bt, mx.concatenate([cl, cl[:1]]), ps],
        "heads": lambda: [mx.concatenate([q, q[:, :1]], axis=1), kp, vp, bt, cl, ps],
        "page-size-pool": lambda: [q, kp, vp, bt, cl, ps + 1],
        "page-size-zero": lambda: [q, kp, vp, bt, cl, 0],
        "kv-pages-float": lambda: [q, kp.astype(q.dtype), vp, bt, cl, ps],
    }
    if c in changes:
        return Call(changes[c](), kw)
    kw.update({"scale-nan": {"scale": math.nan}, "scale-inf": {"scale": -math.inf}, "mask": {"mask": "full"},
               "window-zero": {"window": 0, "mask": "causal"}, "window-negative": {"window": -3, "mask": "causal"},
               "window-unmasked": {"window": 4, "mask": None},
               "kv-dtype-unknown": {"kv_dtype": "float8_e4m3fnuz"},
               "kv-scale-shape": {"v_scale": mx.ones((kp.shape[1] + 1,), dtype=mx.float32)},
               "kv-scale-zero": {"k_scale": 0.0}}[c])
    return Call(call.args, kw)


def _raw(call: Call, lens=None):
    """The unvalidated entry point, with the arguments impl would pass."""
    q, kp, vp, bt, cl, ps = call.args
    D = q.shape[-1] if q.ndim else 1
    scale = call.kwargs["scale"]
    scale = D ** -0.5 if scale is None else scale
    window = call.kwargs["window"] or 0
    kv = {}
    if call.kwargs.get("kv_dtype"):
        scales = [call.kwargs[name] for name in ("k_scale", "v_scale")]
        kv = dict(kv_code=KV_CODES[call.kwargs["kv_dtype"]],
                  **{name: mx.array(s, dtype=mx.float32) if isinstance(s, float) else s
                     for name, s in zip(("k_scale", "v_scale"), scales)})
    out, _ = pagecheck_kernels.paged_attention(q, kp, vp, bt, cl if lens is None else lens, ps, scale,
                                               call.kwargs["mask"] is not None, window, **kv)
    mx.eval(out)
    return out


STATS = collections.Counter()


def assert_matches_oracle(out, call: Call) -> None:
    """Finite, and within the tolerance rule of the float64 oracle (oracles.compare).

    Only the output's own verdict counts here (`against_float64`): with scales up to 2
    the float32 MLX oracles (equation, dense) can miss their own allowance on peaked
    softmaxes; that is about the oracles, and test_differential / test_oracles judge them.
    A batch whose requests are all empty must be exactly zeros; it is checked directly,
    since such a batch may come with a pool of 0 pages or a table of 0 columns, which
    the MLX oracles of oracles.compare cannot gather from (the contract allows both)."""
    assert out.dtype == call.args[0].dtype and out.shape == call.args[0].shape
    host = np.array(out.astype(mx.float32))
    assert np.isfinite(host).all()
    if not (np.array(call.args[4]) > 0).any():
        assert (host == 0).all()
        return
    verdict = compare(out, tuple(call.args), call.kwargs).against_float64
    assert verdict.ok, f"vs float64: {verdict}"


def check(spec: Spec) -> None:
    call = build(spec)
    clause = expected_clause(spec)
    STATS[clause or "computed"] += 1
    if spec.kv and clause is None:
        STATS["computed quantized"] += 1
    if clause is None:
        out = impl.paged_attention(*call.args, **call.kwargs)
        mx.eval(out)
        assert_matches_oracle(out, call)
        assert bits(_raw(call)) == bits(out)
        return
    with pytest.raises(impl.ContractViolation) as info:
        impl.paged_attention(*call.args, **call.kwargs)
    assert info.value.clause == clause, (info.value.clause, str(info.value))
    if spec.corruption:
        if CORRUPTIONS[spec.corruption][1]:
            with pytest.raises(ValueError, match=r"pagecheck\._kernels\.paged_attention"):
                _raw(call)
        return
    # Bad request values: the kernel computes the safe requests and NaNs the others.
    safe = [_safe(spec, b) for b in range(len(spec.context_lens))]
    emptied = mx.array(np.where(safe, np.array(spec.context_lens, dtype=np.int32), 0).astype(np.int32))
    valid = Call(call.args[:4] + [emptied, call.args[5]], call.kwargs)
    expected = impl.paged_attention(*valid.args, **valid.kwargs)
    mx.eval(expected)
    assert_matches_oracle(expected, valid)
    raw = np.array(_raw(call).astype(mx.float32))
    for b, ok in enumerate(safe):
        if ok:
            assert bits(mx.array(raw[b])) == bits(expected[b].astype(mx.float32)), f"request {b}"
        else:
            assert np.isnan(raw[b]).all(), f"request {b} is unsafe but not NaN"


def _fuzzer(max_examples: int, derandomize: bool):
    @settings(max_examples=max_examples, derandomize=derandomize, database=None, deadline=None,
              print_blob=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])
    @given(spec=specs())
    def run(spec):
        check(spec)

    return run


def test_validation_and_kernel_boundary(capsys):
    STATS.clear()
    if FUZZ_SECONDS <= 0:
        _fuzzer(EXAMPLES, derandomize=True)()
        assert STATS["computed"] > 0 and len(STATS) > 3, STATS  # the draws reach both sides
        assert STATS["computed quantized"] > 0 and STATS["kv_dtype"] + STATS["kv_scale"] > 0, STATS
        return
    base = int(os.environ.get("PAGECHECK_FUZZ_SEED") or random.randrange(2 ** 32))
    with capsys.disabled():
        print(f"\n[fuzz] {FUZZ_SECONDS:.0f} s of rounds of 100 calls, PAGECHECK_FUZZ_SEED={base}", flush=True)
    start, rounds = time.monotonic(), 0
    while time.monotonic() - start < FUZZ_SECONDS:
        try:
            seed(base + rounds)(_fuzzer(100, derandomize=False))()
        except BaseException:
            with capsys.disabled():
                print(f"\n[fuzz] failed in round {rounds} (PAGECHECK_FUZZ_SEED={base})", flush=True)
            raise
        rounds += 1
    with capsys.disabled():
        print(f"\n[fuzz] {sum(STATS.values())} calls in {time.monotonic() - start:.0f} s, {rounds} rounds: "
              f"{dict(sorted(STATS.items()))}", flush=True)
