"""The hand-fixture loader's contract-v2 keys (fixtures/hand.py) and the v2 catalog.

The fixtures themselves run in tests/test_hand_fixtures.py (output and lse against the
hand answer and the float64 oracle); here: the new keys reach the Case as the contract
types them (slopes and sinks float32 `[Hq]`, value pages `[P, Hkv, ps, Dv]`, lse float64
`[B, Hq, L]` with -inf for empty slots), malformed ones are refused, first-contract
fixtures are still called with the first contract's keywords only, and every v2 clause
has fixtures of its own.
"""

import math
import re

import mlx.core as mx
import numpy as np
import pytest

from conformance.clauses import CLAUSES
from fixtures.hand import hand_case, hand_info, hand_names
from tests.hand_specs import DROP, load_spec, spec_with

pytestmark = pytest.mark.correctness

V2_CLAUSES = ("softcap", "alibi", "sinks", "lse", "value_dim")


def test_every_v2_clause_has_hand_fixtures():
    clauses = [hand_info(n).clause for n in hand_names()]
    for clause in V2_CLAUSES:
        assert clause in CLAUSES, f"clause {clause!r} missing from conformance/clauses.py"
        assert clauses.count(clause) >= 2, f"clause {clause!r}: {clauses.count(clause)} hand fixtures"


def test_v2_keys_reach_the_case():
    case = hand_case("softcap_alibi_sinks_lse")
    assert case.softcap == pytest.approx(math.log(4)) and case.return_lse
    for x in (case.alibi_slopes, case.sinks):
        assert x.dtype == mx.float32 and x.shape == (case.query.shape[1],)
    assert set(case.kwargs()) == {"scale", "mask", "window", "softcap", "alibi_slopes", "sinks", "return_lse"}
    mla = hand_case("value_dim_mla_192_128")
    assert mla.key_pages.shape[3] == 192 and mla.value_pages.shape[3] == 128
    assert mla.expected.shape == (1, 2, 2, 128) and mla.expected_lse.shape == (1, 2, 2)


def test_empty_slots_get_minus_inf_lse():
    case = hand_case("lse_empty_row")
    assert case.expected_lse.dtype == np.float64 and case.expected_lse.shape == (3, 1, 2)
    assert np.isneginf(case.expected_lse[1]).all() and np.isfinite(case.expected_lse[[0, 2]]).all()
    assert not case.expected[1].any()


def test_first_contract_fixtures_keep_the_first_signature():
    for name in ("course_hand_example", "window_family[w=4]", "extreme_logits[scale=1]"):
        case = hand_case(name)
        assert set(case.kwargs()) == {"scale", "mask", "window"} and case.expected_lse is None


BASE = {"name": "tmp", "catches": "-", "clause": "lse", "derivation": ["-"], "dtype": "float32", "page_size": 2,
        "num_pages": 2, "max_pages": 1, "q_heads": 2, "kv_heads": 1, "head_dim": 2, "scale": 1.0,
        "mask": "causal", "window": None, "query_len": 1, "return_lse": True,
        "requests": [{"block_table": [1], "context_len": 1, "keys": {"rule": "zeros"},
                      "values": [[[3, 3]]], "query": {"rule": "zeros"},
                      "expected": [[[3, 3]], [[3, 3]]], "expected_lse": [[0], [0]]},
                     {"block_table": [-1], "context_len": 0, "expected_lse": [["-inf"], ["-inf"]]}]}
def _load(tmp_path, monkeypatch, **changes):
    return load_spec(tmp_path, monkeypatch, spec_with(BASE, **changes))


def test_a_minimal_v2_spec_loads(tmp_path, monkeypatch):
    case = _load(tmp_path, monkeypatch, sinks=[0.0, 1.0], value_head_dim=2,
                 r0_values={"rule": "per_head", "values": [3]})
    assert np.array(case.value_pages)[1, 0, 0].tolist() == [3, 3] and np.isnan(np.array(case.value_pages)[0]).all()
    assert case.expected_lse.tolist() == [[[0.0], [0.0]], [[-math.inf], [-math.inf]]]


@pytest.mark.parametrize("changes, message", [
    ({"sinks": [0.0]}, "sinks has 1 entries, expected q_heads = 2"),
    ({"alibi_slopes": [1.0, 2.0, 3.0]}, "alibi_slopes has 3 entries"),
    ({"r0_expected_lse": [[None], [0]]}, 'numbers or the string "-inf"'),
    ({"r0_expected_lse": [[0, 0], [0, 0]]}, "expected_lse has shape"),
    ({"r0_expected_lse": DROP}, "return_lse needs expected_lse"),
    ({"return_lse": False}, "expected_lse without return_lse"),
    ({"value_head_dim": 3}, "values has shape"),
    ({"r0_values": {"rule": "per_head", "values": [1, 2]}}, "per_head has 2 values, expected 1 heads"),
])
def test_malformed_v2_keys_are_refused(tmp_path, monkeypatch, changes, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        _load(tmp_path, monkeypatch, **changes)
