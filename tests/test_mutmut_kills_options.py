"""What mutmut showed unpinned in the contract-v2 options' validation (impl/validation.py
`_kv_scale`, `_head_vector`): each rejection's clause and exact message, the bounds of a
float scale, and scales, ALiBi slopes and sinks given as NumPy float32 arrays, which are
taken as they are."""

from __future__ import annotations

import warnings

import mlx.core as mx
import numpy as np
import pytest

import impl
from contract import ScorePipeline
from impl.validation import Geometry, check_pipeline

pytestmark = [pytest.mark.correctness, pytest.mark.builtin_only("the built-in validation's exact messages")]

# 7 pages of 4 positions, 2 KV heads
GEOM = Geometry(batch=2, q_heads=4, kv_heads=2, query_len=3, head_dim=8, num_pages=7, page_size=4, max_pages=3,
                value_dim=8)
F32_MAX = float(np.finfo(np.float32).max)


def _scales(k_scale, v_scale=None):
    opts = check_pipeline(GEOM, ScorePipeline(kv_dtype="int8", k_scale=k_scale, v_scale=v_scale))
    return opts.k_scale, opts.v_scale


BAD_SCALES = {
    "zero": (0.0, "k_scale must be a finite float32 value > 0, got 0.0"),
    "negative": (-2, "k_scale must be a finite float32 value > 0, got -2"),
    "past-float32": (1e39, "k_scale must be a finite float32 value > 0, got 1e+39"),
    "nan": (float("nan"), "k_scale must be a finite float32 value > 0, got nan"),
    "numpy-float64": (np.ones(2), "k_scale must be float32, got float64"),
    "list": ([1.0, 2.0], "k_scale must be a float or a float32 mlx.core.array, got list"),
    "bool": (True, "k_scale must be a float or a float32 mlx.core.array, got bool"),
    "mlx-float16": (mx.ones((2,), dtype=mx.float16), "k_scale must be float32, got float16"),
    "shape": (mx.ones((3,)), "k_scale shape (3,) is none of [] (per tensor), [Hkv] = (2,) (per head) or "
                             "[P, Hkv, page_size] = (7, 2, 4) (per token)"),
}


@pytest.mark.parametrize("which", ["k_scale", "v_scale"])
@pytest.mark.parametrize("name", sorted(BAD_SCALES))
def test_each_bad_scale_says_exactly_what_was_wrong(name, which):
    scale, message = BAD_SCALES[name]
    with pytest.raises(impl.ContractViolation) as e:
        _scales(*((scale, None) if which == "k_scale" else (None, scale)))
    assert (e.value.clause, str(e.value)) == ("kv_scale", message.replace("k_scale", which))


def test_a_float_scale_up_to_float32s_largest_is_a_float32_scalar():
    k, v = _scales(F32_MAX, 0.5)
    assert (k.dtype, k.shape, k.item(), v.item()) == (mx.float32, (), F32_MAX, 0.5)
    assert _scales(None)[0].item() == 1.0, "no scale is 1.0"


@pytest.mark.parametrize("shape", [(), (2,), (7, 2, 4)])
def test_numpy_float32_scales_are_taken_as_given(shape):
    given = np.random.default_rng(3).uniform(0.5, 2.0, shape).astype(np.float32)
    k, _ = _scales(given)
    assert isinstance(k, mx.array) and k.dtype == mx.float32 and np.array_equal(np.array(k), given)


@pytest.mark.parametrize("option", ["scale", "softcap", "k_scale"])
def test_values_past_float32_are_rejected_without_a_warning(option):
    """A bound compared as np.float32 casts the value first: NumPy 2 warns of the
    overflow, and under -W error (as many test suites run) that warning, not the
    ContractViolation, reached the caller."""
    pipeline = ScorePipeline(**{option: 1e39}, **({"kv_dtype": "int8"} if option == "k_scale" else {}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(impl.ContractViolation, match="must be a finite"):
            check_pipeline(GEOM, pipeline)


@pytest.mark.parametrize("option", ["alibi_slopes", "sinks"])
def test_head_vectors_from_numpy_float32_are_taken_as_given(option):
    given = np.array([0.5, -1.0, 2.0, 0.25], dtype=np.float32)
    taken = getattr(check_pipeline(GEOM, ScorePipeline(**{option: given})), option)
    assert isinstance(taken, mx.array) and taken.dtype == mx.float32 and np.array_equal(np.array(taken), given)


@pytest.mark.parametrize("option", ["alibi_slopes", "sinks"])
@pytest.mark.parametrize("bad, message", [(np.ones(4), "must be float32, got float64"),
                                          ([0.5] * 4, "must be an mlx.core.array (float32 [Hq]), got list")])
def test_each_bad_head_vector_says_exactly_what_was_wrong(option, bad, message):
    with pytest.raises(impl.ContractViolation) as e:
        check_pipeline(GEOM, ScorePipeline(**{option: bad}))
    assert (e.value.clause, str(e.value)) == (option, f"{option} {message}")


def test_softcap_up_to_float32s_largest_is_taken():
    assert check_pipeline(GEOM, ScorePipeline(softcap=F32_MAX)).softcap == F32_MAX


@pytest.mark.parametrize("name", ["k_scale", "v_scale"])
def test_a_scale_without_a_kv_dtype_says_so(name):
    with pytest.raises(impl.ContractViolation) as e:
        check_pipeline(GEOM, ScorePipeline(**{name: 0.5}))
    assert (e.value.clause, str(e.value)) == (
        "kv_scale", f"{name} is given but kv_dtype is None: scales belong to quantized pages")


@pytest.mark.parametrize("pool, message", [
    (dict(), "k_scale given, but an unquantized pool has no scales"),
    (dict(kv_dtype="int8", scales="token"), "k_scale given, but token scales are computed by the writes"),
])
def test_a_pool_refuses_scales_it_cannot_take_and_says_why(pool, message):
    """A pool's constructor (impl/pool.py `_layer_scales`): scales given where the pool has
    none to take, each with its reason (mutmut 2026-12-03: only the clause was pinned)."""
    from fixtures.serving import make_pool
    from impl.errors import ServingError

    with pytest.raises(ServingError) as e:
        make_pool(**pool, k_scale=0.5)
    assert (e.value.clause, str(e.value)) == ("kv_scale", message)


POOL_REJECTIONS = {
    "format": (dict(kv_dtype="int4"), "kv_dtype",
               "kv_dtype must be None or one of float8_e4m3fn, float8_e5m2, int8, got 'int4'"),
    "packed-float32": (dict(layout="amx_packed"), "kv_layout", "an amx_packed pool holds bfloat16 pages, got float32"),
    "packed-codes": (dict(kv_dtype="int8", layout="amx_packed", fill=0.0), "kv_layout",
                     "an amx_packed pool holds bfloat16 pages, got float32 as int8 codes"),
    "scale-float16": (dict(kv_dtype="int8", k_scale=mx.ones(2, dtype=mx.float16)), "kv_scale",
                      "k_scale must be float32, got float16"),
    "scale-string": (dict(kv_dtype="int8", k_scale="1.0"), "kv_scale",
                     "k_scale must be a number or an array of numbers, got '1.0'"),
    "scale-shape": (dict(kv_dtype="int8", k_scale=[1.0, 2.0, 3.0]), "kv_scale",
                    "tensor k_scale must have shape [] (every layer) or [2], got [3]"),
    "scale-past-float32": (dict(kv_dtype="int8", k_scale=1e39), "kv_scale",
                           "k_scale must be finite float32 values > 0, got [1e+39]"),
    "granularity": (dict(kv_dtype="int8", scales="channel"), "kv_scale",
                    "scales must be one of tensor, head, token, got 'channel'"),
    "scales-without-format": (dict(scales="head"), "kv_scale",
                              "scales='head' needs a kv_dtype (an unquantized pool has no scales)"),
    "fill": (dict(kv_dtype="int8", fill=1.0), "kv_dtype",
             "a int8 pool starts poisoned (fill NaN) or zero (fill 0.0), got fill=1.0"),
    "v-scale-shape": (dict(kv_dtype="int8", v_scale=[1.0, 2.0, 3.0]), "kv_scale",
                      "tensor v_scale must have shape [] (every layer) or [2], got [3]"),
    "head-scales-first-four": (dict(kv_dtype="int8", scales="head", kv_heads=3, k_scale=[[1, 2, 3], [4, -5, 6]]),
                               "kv_scale", "k_scale must be finite float32 values > 0, got [1.0, 2.0, 3.0, 4.0]"),
}


@pytest.mark.parametrize("name", sorted(POOL_REJECTIONS))
def test_each_pool_rejection_says_exactly_what_was_wrong(name):
    """The pool constructor's format, layout and scale rejections (impl/pool.py
    `_check_format`, `_check_layout`, `_layer_scales`), clause and whole message, with
    warnings as errors: a scale past float32 is rejected, not warned about (mutmut
    2026-12-03: only the clauses were pinned)."""
    from fixtures.serving import make_pool
    from impl.errors import ServingError

    pool, clause, message = POOL_REJECTIONS[name]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ServingError) as e:
            make_pool(**pool)
    assert (e.value.clause, str(e.value)) == (clause, message)


def _codes_call(kv_dtype, key_dtype=mx.uint8, value_dtype=mx.uint8):
    """impl.paged_attention on 1-byte pages (7 pages of 4 positions, 2 KV heads) with
    `kv_dtype`; pages of other dtypes where given."""
    q = mx.zeros((1, 4, 1, 8), dtype=mx.float32)
    kp, vp = mx.zeros((7, 2, 4, 8), dtype=key_dtype), mx.zeros((7, 2, 4, 8), dtype=value_dtype)
    table, lens = mx.zeros((1, 3), dtype=mx.int32), mx.array([4], dtype=mx.int32)
    return impl.paged_attention(q, kp, vp, table, lens, 4, kv_dtype=kv_dtype)


# mutmut 2026-12-03: both messages could be dropped or garbled unseen (only clauses were pinned)
CODE_REJECTIONS = {
    "unknown-format": (("float8",), "kv_dtype must be None or one of float8_e4m3fn, float8_e5m2, int8, "
                                    "got 'float8'"),
    "not-a-string": ((8,), "kv_dtype must be None or one of float8_e4m3fn, float8_e5m2, int8, got 8"),
    "key-pages-float": (("int8", mx.float32, mx.int8), "key_pages dtype float32: kv_dtype int8 pages hold int8 codes"),
    "value-pages-int8": (("float8_e5m2", mx.uint8, mx.int8),
                         "value_pages dtype int8: kv_dtype float8_e5m2 pages hold uint8 codes"),
}


@pytest.mark.parametrize("name", sorted(CODE_REJECTIONS))
def test_each_kv_dtype_rejection_says_exactly_what_was_wrong(name):
    args, message = CODE_REJECTIONS[name]
    with pytest.raises(impl.ContractViolation) as e:
        _codes_call(*args)
    assert (e.value.clause, str(e.value)) == ("kv_dtype", message)
