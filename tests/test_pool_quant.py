"""Quantized page pools (impl/pool.py): scales by granularity, in-place updates,
rejections that write nothing, copies and poison, and attention over what the writes
stored. The encoding itself is tests/test_quantize_codes.py's.
"""

import math

import mlx.core as mx
import numpy as np
import pytest

import impl
from contract import max_finite
from fixtures.quantized import code_values, poison_code
from fixtures.serving import assert_same_state, make_pool, pool_state, raw
from impl.batch import StepBatch
from impl.cache import PagedCache
from impl.errors import ServingError
from impl.pool import PagePool, pool_copies
from tests.quant_reference import reference_codes

pytestmark = [pytest.mark.correctness, pytest.mark.builtin_only("pagecheck's own page pool, cache and scheduler")]

FORMATS = ("float8_e4m3fn", "float8_e5m2", "int8")
GRANULARITIES = ("tensor", "head", "token")


def _rows(rng, n, heads=2, d=8, scale=3.0) -> np.ndarray:
    return (rng.standard_normal((n, heads, d)) * scale).astype(np.float32)


def _codes(pool, layer):
    return raw(pool.keys(layer)), raw(pool.values(layer))


@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_tensor_and_head_scales_divide_each_layer_and_head(kv_dtype):
    """code = encode(fl32(x / s)) with s the layer's (tensor) or the layer's and head's
    scale; scales that are not powers of 2 make x / s round, so the division is visible."""
    rng = np.random.default_rng(3)
    top = max_finite(kv_dtype)
    k_tensor, v_tensor = np.float32([0.37, 1.9]) * 8 / top, np.float32([0.71, 0.23]) * 8 / top
    k_head = np.float32([[0.3, 2.2], [1.1, 0.45]]) * 8 / top
    v_head = np.float32([[0.6, 0.13], [3.7, 0.9]]) * 8 / top
    for scales, ks, vs in (("tensor", k_tensor, v_tensor), ("head", k_head, v_head)):
        pool = make_pool(kv_dtype=kv_dtype, scales=scales, k_scale=ks, v_scale=vs)
        pool.allocate(3)
        for layer in range(2):
            k, v = _rows(rng, 5), _rows(rng, 5)
            pool.write(layer, [0, 3, 9, 4, 7], mx.array(k), mx.array(v))
            got_k, got_v = (x.transpose(0, 2, 1, 3).reshape(-1, 2, 8)[[0, 3, 9, 4, 7]] for x in _codes(pool, layer))
            opts = pool.kv_options(layer)
            for got, x, s, given in ((got_k, k, opts["k_scale"], ks), (got_v, v, opts["v_scale"], vs)):
                assert np.array_equal(np.array(s), given[layer])
                per_head = np.array(s).reshape(1, -1, 1) if scales == "head" else np.array(s)
                assert got.tolist() == reference_codes(x / per_head, kv_dtype).tolist()


@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_token_scales_are_computed_and_stored_at_their_slots(kv_dtype):
    """Each (token, KV head) row gets s = fl32(max|x|) / fl32(max finite) at its physical
    slot; a zero row gets 1.0 (codes 0); a row with NaN or inf gets NaN (and NaN codes,
    int8: 0) so the poison shows; unwritten slots keep their NaN."""
    rng = np.random.default_rng(5)
    pool = make_pool(kv_dtype=kv_dtype, scales="token")
    pool.allocate(4)
    k, v = _rows(rng, 6), _rows(rng, 6, scale=1e-3)
    k[1, 0] = 0.0
    k[2, 1, 3] = np.nan
    v[3, 0, 5] = -np.inf
    k[4, 1, :] = 2.0**-140  # a float32 subnormal row: max / 57344 underflows to 0 (scale 1.0) in e5m2
    slots = [13, 2, 7, 0, 15, 8]
    pool.write(1, slots, mx.array(k), mx.array(v))
    opts = pool.kv_options(1)
    top = np.float32(max_finite(kv_dtype))
    for x, s, codes in ((k, opts["k_scale"], raw(pool.keys(1))), (v, opts["v_scale"], raw(pool.values(1)))):
        s = np.array(s).transpose(0, 2, 1).reshape(-1, 2)  # [slot, head]
        amax = np.abs(x).max(axis=-1)
        want = np.where(np.isfinite(x).all(axis=-1), amax / top, np.float32(np.nan))
        want = np.where(want == 0, np.float32(1.0), want)
        assert raw(mx.array(s[slots])).tolist() == raw(mx.array(want.astype(np.float32))).tolist()
        unwritten = np.setdiff1d(np.arange(s.shape[0]), slots)
        assert np.isnan(s[unwritten]).all()
        got = codes.transpose(0, 2, 1, 3).reshape(-1, 2, 8)[slots]
        assert got.tolist() == reference_codes(x / want[..., None], kv_dtype).tolist()
    assert raw(pool.keys(1)).transpose(0, 2, 1, 3).reshape(-1, 2, 8)[2, 0].tolist() == [0] * 8
    assert np.array(opts["k_scale"])[0, 0, 2] == 1.0  # the zero row (slot 2, head 0)
    # each finite row's largest element lands on +-max
    finite_rows = np.isfinite(k).all(axis=-1) & (np.abs(k).max(axis=-1) > 1e-30)
    decoded = np.abs(code_values(kv_dtype)[raw(pool.keys(1)).transpose(0, 2, 1, 3).reshape(-1, 2, 8)[slots]])
    assert (decoded[finite_rows].max(axis=-1) == max_finite(kv_dtype)).all()


def test_a_nan_row_reads_back_nan_in_every_format():
    """The point of the NaN scale: a row holding NaN decodes to NaN under every format,
    int8 (whose codes cannot be NaN) through its scale."""
    for kv_dtype in FORMATS:
        pool = make_pool(kv_dtype=kv_dtype, scales="token", num_layers=1)
        pool.allocate(1)
        x = np.ones((1, 2, 8), np.float32)
        x[0, 1, 0] = np.nan
        pool.write(0, [1], mx.array(x), mx.array(x))
        opts = pool.kv_options(0)
        decoded = code_values(kv_dtype)[raw(pool.keys(0))[0, :, 1]] * np.array(opts["k_scale"])[0, :, 1, None]
        assert np.isfinite(decoded[0]).all() and np.isnan(decoded[1]).all()


# -- in place, transactional, copies, poison -------------------------------------------------------
def _evaluate(pool, layer) -> None:
    """Evaluates layer's pages and scales (what a step does before the next write)."""
    mx.eval(pool.keys(layer), pool.values(layer), [a for a in pool.kv_options(layer).values() if isinstance(a, mx.array)])


@pytest.mark.parametrize("scales", GRANULARITIES)
@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_writes_stay_in_place(kv_dtype, scales):
    """Quantizing writes, token-scale writes and page copies take the buffers over: a
    large pool (2 x 8 MiB of codes a layer) is never copied."""
    pool = PagePool(num_layers=2, kv_heads=8, head_dim=128, page_size=16, num_pages=512, kv_dtype=kv_dtype,
                    scales=scales, k_scale=None, v_scale=None)
    pool.allocate(8)
    rng = np.random.default_rng(1)
    start = pool_copies()
    for step in range(6):
        layer = step % 2
        rows = mx.array(_rows(rng, 3, heads=8, d=128))
        pool.write(layer, [step, 40 + step, 100 + step], rows, rows)
        _evaluate(pool, layer)
    pool.copy_pages([0, 2], [5, 7])
    for layer in range(2):
        _evaluate(pool, layer)
    assert pool_copies() == start
    if scales == "token":
        assert not np.isnan(np.array(pool.kv_options(1)["k_scale"])[0, :, 1]).any()


def test_held_token_scales_are_copied_not_overwritten():
    """Holding kv_options' scales across a write forces exactly one copy (of the scales),
    and the held array keeps its old contents."""
    pool = make_pool(kv_dtype="float8_e4m3fn", scales="token")
    pool.allocate(2)
    rows = mx.array(_rows(np.random.default_rng(2), 1))
    pool.write(0, [1], rows, rows)
    held = pool.kv_options(0)["k_scale"]
    old, start = raw(held), pool_copies()
    pool.write(0, [6], rows * 2, rows * 2)
    mx.eval(pool.keys(0), pool.values(0), pool.kv_options(0)["k_scale"], pool.kv_options(0)["v_scale"])
    assert pool_copies() == start + 1
    assert np.array_equal(raw(held), old)
    fresh = np.array(pool.kv_options(0)["k_scale"])
    assert np.array_equal(fresh[1, :, 2], 2 * np.array(held)[0, :, 1])


def _written_pool(kv_dtype="float8_e5m2", scales="token"):
    pool = make_pool(kv_dtype=kv_dtype, scales=scales)
    pool.allocate(3)
    rng = np.random.default_rng(11)
    for layer in range(2):
        pool.write(layer, [0, 1, 5, 9], mx.array(_rows(rng, 4)), mx.array(_rows(rng, 4)))
    return pool


_GOOD = mx.zeros((2, 2, 8))


@pytest.mark.parametrize("keys,values,slots,clause", [
    (_GOOD, _GOOD.astype(mx.float16), [2, 3], "append_dtype"),
    (_GOOD.astype(mx.bfloat16), _GOOD, [2, 3], "append_dtype"),
    (_GOOD, mx.zeros((2, 2, 8), dtype=mx.uint8), [2, 3], "append_dtype"),
    (_GOOD, mx.zeros((2, 2, 4)), [2, 3], "append_shape"),
    (_GOOD, _GOOD, [2, 2], "slot"),
    (_GOOD, _GOOD, [2, 48], "slot"),
    (_GOOD, _GOOD, [2, 20], "slot"),  # page 5 is free
])
@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_bad_write_changes_no_code_and_no_scale(kv_dtype, keys, values, slots, clause):
    pool = _written_pool(kv_dtype)
    before, copies = pool_state(pool), pool_copies()
    assert len(before.scales) == 2
    with pytest.raises(ServingError) as e:
        pool.write(1, slots, keys, values)
    assert type(e.value) is ServingError and e.value.clause == clause
    assert_same_state(before, pool_state(pool))
    assert pool_copies() == copies


def test_state_snapshot_sees_a_changed_scale():
    """assert_same_state compares the token scales too (else the test above could not fail
    on a scale-only change)."""
    pool = _written_pool()
    before = pool_state(pool)
    pool.write(0, [2], mx.ones((1, 2, 8)), mx.ones((1, 2, 8)))
    with pytest.raises(AssertionError):
        assert_same_state(before, pool_state(pool))


@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_copy_pages_carries_token_scales(kv_dtype):
    pool = _written_pool(kv_dtype)
    before = pool_state(pool)
    pool.copy_pages([1], [2])
    after = pool_state(pool)
    for layer in range(2):
        for bits in (after.keys[layer], after.values[layer], *after.scales[layer]):
            assert np.array_equal(bits[2], bits[1])
        for x, y in zip(before.scales[layer], after.scales[layer]):
            assert np.array_equal(x[:2], y[:2])
    assert pool.stats().pages_copied == 1


@pytest.mark.parametrize("scales", GRANULARITIES)
@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_unwritten_and_freed_slots_are_poisoned(kv_dtype, scales):
    """A fresh pool and, with poison_freed, a freed page hold the poison code (fp8 NaN
    0x7f, int8 -128) and, with token scales, NaN scales; fill=0.0 starts at code 0 and
    scale 1.0."""
    pool = make_pool(kv_dtype=kv_dtype, scales=scales, poison_freed=True)
    code = poison_code(kv_dtype) & 0xFF
    for layer in range(2):
        assert (raw(pool.keys(layer)) == code).all() and (raw(pool.values(layer)) == code).all()
    pool.allocate(2)
    rows = mx.array(_rows(np.random.default_rng(4), 8))
    for layer in range(2):
        pool.write(layer, range(8), rows, rows)
    assert pool.free([0]) == [0]
    for layer in range(2):
        keys, values = _codes(pool, layer)
        assert (keys[0] == code).all() and (values[0] == code).all()
        assert (keys[1] != code).any() and (values[1] != code).any()
        opts = pool.kv_options(layer)
        if scales == "token":
            for s in (np.array(opts["k_scale"]), np.array(opts["v_scale"])):
                assert np.isnan(s[0]).all() and np.isfinite(s[1]).all()
    zero = make_pool(kv_dtype=kv_dtype, scales="token", fill=0.0)
    assert (raw(zero.keys(0)) == 0).all() and (np.array(zero.kv_options(1)["v_scale"]) == 1.0).all()


# -- construction ---------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides,clause", [
    ({"kv_dtype": "float8"}, "kv_dtype"), ({"kv_dtype": "float8_e4m3fnuz"}, "kv_dtype"),
    ({"kv_dtype": 8}, "kv_dtype"), ({"kv_dtype": "int8", "fill": 1.0}, "kv_dtype"),
    ({"kv_dtype": "int8", "scales": "channel"}, "kv_scale"), ({"scales": "head"}, "kv_scale"),
    ({"k_scale": 1.0}, "kv_scale"),
    ({"kv_dtype": "int8", "scales": "token", "k_scale": 0.5}, "kv_scale"),
    ({"kv_dtype": "int8", "k_scale": 0.0}, "kv_scale"), ({"kv_dtype": "int8", "v_scale": -1.0}, "kv_scale"),
    ({"kv_dtype": "int8", "k_scale": math.nan}, "kv_scale"), ({"kv_dtype": "int8", "k_scale": math.inf}, "kv_scale"),
    ({"kv_dtype": "int8", "k_scale": 1e39}, "kv_scale"), ({"kv_dtype": "int8", "k_scale": 1e-50}, "kv_scale"),
    ({"kv_dtype": "int8", "k_scale": True}, "kv_scale"), ({"kv_dtype": "int8", "k_scale": "1.0"}, "kv_scale"),
    ({"kv_dtype": "int8", "k_scale": [1.0, 2.0, 3.0]}, "kv_scale"),
    ({"kv_dtype": "int8", "k_scale": np.ones(2, np.float64)}, "kv_scale"),
    ({"kv_dtype": "int8", "k_scale": mx.ones(2, dtype=mx.float16)}, "kv_scale"),
    ({"kv_dtype": "int8", "scales": "head", "k_scale": np.ones((2, 3), np.float32)}, "kv_scale"),
    ({"kv_dtype": "int8", "scales": "head", "k_scale": np.ones((3,), np.float32)}, "kv_scale"),
    ({"kv_dtype": "int8", "scales": "head", "k_scale": np.float32([[1, 1], [1, 0]])}, "kv_scale"),
    ({"kv_dtype": "int8", "dtype": mx.int8}, "append_dtype"),
])
def test_bad_quantized_pool_is_rejected(overrides, clause):
    with pytest.raises(ServingError) as e:
        make_pool(**overrides)
    assert type(e.value) is ServingError and e.value.clause == clause


@pytest.mark.parametrize("given,scales,want", [
    (0.5, "tensor", [[0.5], [0.5]]), ([0.5, 2.0], "tensor", [[0.5], [2.0]]),
    (mx.array([0.25, 4.0]), "tensor", [[0.25], [4.0]]), (np.float32([1, 2]), "head", [[1, 2], [1, 2]]),
    (np.float32([[1, 2], [3, 4]]), "head", [[1, 2], [3, 4]]), (None, "head", [[1, 1], [1, 1]]),
    (None, "tensor", [[1], [1]]),
])
def test_given_scales_per_layer(given, scales, want):
    pool = make_pool(kv_dtype="float8_e4m3fn", scales=scales, k_scale=given)
    for layer in range(2):
        s = pool.kv_options(layer)["k_scale"]
        assert s.dtype == mx.float32 and s.shape == (() if scales == "tensor" else (2,))
        assert np.array(s).ravel().tolist() == want[layer]
        assert np.array(pool.kv_options(layer)["v_scale"]).ravel().tolist() == [1.0] * len(want[layer])


@pytest.mark.parametrize("kv_dtype,scales,per_element", [
    (None, "tensor", 4), ("int8", "tensor", 1), ("float8_e5m2", "head", 1), ("float8_e4m3fn", "token", 1 + 4 / 8)])
def test_bytes_per_page_counts_codes_and_token_scales(kv_dtype, scales, per_element):
    """2 (K, V) x 2 layers x 2 heads x 4 slots x 8 elements, each 1 byte (codes) plus,
    with token scales, 4 bytes a row of 8; capacity_bytes divides by it."""
    pool = make_pool(kv_dtype=kv_dtype, scales=scales, capacity_bytes=5 * 1024)
    assert pool.bytes_per_page == int(2 * 2 * 2 * 4 * 8 * per_element)
    assert pool.num_pages == 5 * 1024 // pool.bytes_per_page
    assert pool.keys(0).shape == (pool.num_pages, 2, 4, 8)
    assert pool.kv_options(0).get("kv_dtype") == kv_dtype


# -- attention over what the pool wrote -----------------------------------------------------------
def attention_f64(q, keys, values, lens, scale):
    """Causal attention, float64: q [B, Hq, L, D]; keys[b], values[b] float64 [n_b, Hkv, D]
    in logical order; query row l sits at lens[b] - L + l; head h reads KV head h // G."""
    B, Hq, L, _ = q.shape
    out = np.zeros(q.shape[:3] + (values[0].shape[-1],))
    for b in range(B):
        G = Hq // keys[b].shape[1]
        for h in range(Hq):
            k, v = keys[b][:, h // G], values[b][:, h // G]
            for row in range(L):
                p = lens[b] - L + row
                s = scale * (k[:p + 1] @ q[b, h, row])
                w = np.exp(s - s.max())
                out[b, h, row] = w @ v[:p + 1] / w.sum()
    return out


def _dequantized(codes, kv_dtype, scale):
    """float64 pages decode(code) * s with s broadcast by its granularity."""
    s = np.asarray(scale, dtype=np.float64)
    s = s[..., None] if s.ndim == 3 else s[:, None, None] if s.ndim == 1 else s
    return code_values(kv_dtype)[codes] * s


def _logical(pages, cache):
    ps = pages.shape[2]
    return np.stack([pages[cache.pages[j // ps], :, j % ps] for j in range(cache.length)])


# |quantized - float| output error over max |V|: half a code step relative on V (e4m3 2^-4,
# e5m2 2^-3, int8 1/254 of the row's or tensor's max) plus what K's error does to the
# weights. Measured on this test's data (2026-12-02): at most 0.048, 0.089, 0.0084.
QUANT_ERROR = {"float8_e4m3fn": 0.1, "float8_e5m2": 0.18, "int8": 0.02}


@pytest.mark.parametrize("scales", GRANULARITIES)
@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_attention_over_the_quantized_pool(kv_dtype, scales):
    """Two interleaved requests written through caches (scattered pages, a partial tail,
    a prefill of L = 3): the operator over pool.keys / values with pool.kv_options equals
    float64 attention over the dequantized pages (1e-5 of the output's range) and is
    within the format's quantization error of attention over the float K/V."""
    rng = np.random.default_rng(17)
    n = (9, 14)
    k_rows = [[_rows(rng, m, d=16, scale=2.0) for m in n] for _ in range(2)]
    v_rows = [[_rows(rng, m, d=16, scale=2.0) for m in n] for _ in range(2)]
    top = max_finite(kv_dtype)

    def calibrated(rows):  # max |x| per layer (tensor) or per layer and head, over max finite
        axes = (0, 2) if scales == "head" else None
        return np.stack([np.abs(np.concatenate(r)).max(axis=axes) / top for r in rows]).astype(np.float32)

    given = {} if scales == "token" else dict(k_scale=calibrated(k_rows), v_scale=calibrated(v_rows))
    pool = make_pool(kv_dtype=kv_dtype, scales=scales, head_dim=16, num_pages=10, **given)
    caches = [PagedCache(pool), PagedCache(pool)]
    for start, stop in ((0, 5), (5, 9)):  # two chunks each, interleaved: the requests' pages alternate
        for b in range(2):
            lo, hi = start * n[b] // 9, stop * n[b] // 9
            caches[b].append([mx.array(k_rows[layer][b][lo:hi]) for layer in range(2)],
                             [mx.array(v_rows[layer][b][lo:hi]) for layer in range(2)])
    assert [c.length for c in caches] == list(n)
    table = np.full((2, 4), -1, np.int32)
    for b, c in enumerate(caches):
        table[b, :len(c.pages)] = c.pages
    assert sorted(table[table >= 0].tolist()) != table[table >= 0].tolist()  # not in order
    lens, L, scale = np.array(n, np.int32), 3, 16 ** -0.5
    q = rng.standard_normal((2, 4, L, 16)).astype(np.float32)
    for layer in range(2):
        opts = pool.kv_options(layer)
        out = np.array(impl.paged_attention(mx.array(q), pool.keys(layer), pool.values(layer), mx.array(table),
                                            mx.array(lens), pool.page_size, **opts))
        kp = _dequantized(raw(pool.keys(layer)), kv_dtype, np.array(opts["k_scale"]))
        vp = _dequantized(raw(pool.values(layer)), kv_dtype, np.array(opts["v_scale"]))
        want = attention_f64(q.astype(np.float64), [_logical(kp, c) for c in caches],
                             [_logical(vp, c) for c in caches], lens, scale)
        assert np.isfinite(want).all()
        assert np.abs(out - want).max() <= 1e-5 * np.abs(want).max()
        exact = attention_f64(q.astype(np.float64), k_rows[layer], v_rows[layer], lens, scale)
        vmax = max(np.abs(v).max() for v in v_rows[layer])
        assert np.abs(out - exact).max() <= QUANT_ERROR[kv_dtype] * vmax


@pytest.mark.parametrize("kv_dtype", FORMATS)
def test_step_batch_attends_with_the_pools_scales(kv_dtype):
    """The serving path (StepBatch) passes kv_options along: its output is the operator's
    over the same pool, bit for bit."""
    rng = np.random.default_rng(23)
    pool = make_pool(kv_dtype=kv_dtype, scales="token", num_layers=1)
    cache = PagedCache(pool)
    cache.reserve(6)
    batch = StepBatch([cache], 6)
    k, v = (mx.array(rng.standard_normal((1, 2, 6, 8)).astype(np.float32)) for _ in range(2))
    batch.write(0, k, v)
    q = mx.array(rng.standard_normal((1, 4, 6, 8)).astype(np.float32))
    got = np.array(batch.attend(0, q))
    want = np.array(impl.paged_attention(q, pool.keys(0), pool.values(0), mx.array(np.int32([cache.pages])),
                                         mx.array(np.int32([6])), pool.page_size, **pool.kv_options(0)))
    assert np.isfinite(got).all() and np.array_equal(got, want)
