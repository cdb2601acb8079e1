"""The four oracles: the course's hand example, and agreement with each other (contract v2
options too; tests/test_oracles_v2.py checks each feature on its own)."""

import mlx.core as mx
import numpy as np
import pytest

import oracles
from fixtures import hand_case, paged_case, to_numpy
from oracles.compare import compare

pytestmark = pytest.mark.correctness

ONE_ULP_F32_AT_4 = 2.0 ** -21  # spacing of float32 values in [2, 4)


def test_float64_oracle_hand_example_is_exact():
    case = hand_case("course_hand_example")
    out = case.run(oracles.float64)
    assert out.dtype == np.float64
    np.testing.assert_allclose(out, case.expected, rtol=0, atol=4 * np.finfo(np.float64).eps)


@pytest.mark.parametrize("name", sorted(oracles.MLX_ORACLES))
def test_mlx_oracle_hand_example(name):
    """[3, 4] up to float32 rounding (6e+3 over 2e+1 is not exact in float32), NaN never read."""
    case = hand_case("course_hand_example")
    out = case.run(oracles.MLX_ORACLES[name])
    assert out.dtype == mx.float32 and out.shape == (1, 1, 1, 2)
    np.testing.assert_allclose(to_numpy(out), case.expected, rtol=0, atol=ONE_ULP_F32_AT_4)


# contract v2 (REFERENCE.md 1b) beside the first contract's call: sinks and ALiBi slopes
# exact in every dtype (MLX SDPA takes them in the query's dtype), and a capped call with
# its LSE (SDPA not applicable: compare leaves it out with the reason)
V2 = {
    "v1": {},
    "sinks-alibi": dict(sinks=[0.5, -1.0, 2.0, 0.25], alibi_slopes=[0.5, 0.25, 0.125, 0.0625]),
    "softcap-lse": dict(softcap=2.5, return_lse=True),
}


@pytest.mark.parametrize("v2", list(V2))
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("mask,window", [("causal", None), (None, None), ("causal", 5)])
def test_oracles_agree(dtype, mask, window, v2):
    case = paged_case(context_lens=[37, 0, 12], query_len=9, q_heads=4, kv_heads=2, head_dim=16,
                      page_size=5, dtype=dtype, mask=mask, window=window, seed=3)
    case = case.with_(**{k: mx.array(np.array(v, dtype=np.float32)) if isinstance(v, list) else v
                         for k, v in V2[v2].items()})
    got = case.run(oracles.MLX_ORACLES["equation"])
    result = compare(got, case.args(), case.kwargs())
    assert not result.failures(), result.failures()
    out = got[0] if case.return_lse else got
    assert np.all(to_numpy(out)[1] == 0), "empty slot must give zeros"
    if case.return_lse:
        assert np.isneginf(np.array(got[1])[1]).all(), "empty slot must give lse -inf"
        assert "sdpa" in result.not_applicable and set(result.lse_oracle_self) == {"equation", "dense"}
    else:
        assert not result.not_applicable and set(result.oracle_self) == set(oracles.MLX_ORACLES)
