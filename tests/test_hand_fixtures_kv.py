"""The quantized hand fixtures (fixtures/data/kv_*.json, clause `kv_format`): 8-bit K/V
codes whose answers were derived by hand (REFERENCE.md 1b, contract/kv_format.py).

They decode every special code of e4m3fn (subnormals, smallest normal, 448, -0, NaN) and
e5m2 (subnormals, 57344, inf / NaN where no row looks), int8's extremes, the largest
codes times a scale at float16's limit, a K scale and a different V scale, per-KV-head
scales 2^k apart under GQA, per-token scales behind a permuted block table, and e5m2
codes that e4m3 decodes otherwise. They are listed apart from the unquantized catalog
(`hand_names(kv=True)`, fixtures/hand.py), so an implementation runs them only here, where
one that declares no KV format is skipped by the `attention` fixture's declaration check.

Each fixture runs against the implementation under test with the comparison of
tests/test_hand_fixtures.py: output dtype and shape, the tolerance rule against the hand
answer, bit equality where the derivation shows the result exact. A fixture may expect
NaN (a NaN code a visible row reads: attention over the dequantized values is NaN
there); NaN must then appear exactly there and the rule (and the bits) hold elsewhere.
The allowance is measured on the same call over the dequantized pages: the pages are
decoded here with the fixtures' own table (fixtures.quantized.code_values, sharing
nothing with impl/ or oracles/) and their scales, SDPA's error on them when SDPA can take
them in the query's dtype and answers finitely, else the a-priori E_na.

The hand answers are checked twice: against the float64 oracle on the quantized call
(the oracle decodes on its own), and against the float64 oracle on the pages decoded
here (the hand arithmetic alone, whatever the oracle's decoder). Then the loader's KV
keys: codes and scales reach the Case as the contract types them (token scales at the
physical slot, NaN codes and NaN scales where nothing is written), and malformed
fixtures are refused.
"""

import re

import mlx.core as mx
import numpy as np
import pytest

import oracles
from contract import GRANULARITIES, KV_DTYPES, granularity_of, storage_dtype
from fixtures import DTYPES, bits, to_numpy
from fixtures.hand import hand_case, hand_fixtures, hand_info, hand_names, hand_spec
from fixtures.quantized import code_values, poison_code
from oracles import NotApplicable
from oracles.compare import call_logit_error, value_scale
from oracles.tolerance import Verdict, allowed_error, allowed_error_unmeasured, max_abs_error, ref_scale
from tests.hand_specs import load_spec, spec_with

pytestmark = pytest.mark.correctness

REQUIRED = (
    "kv_e4m3_specials", "kv_e4m3_nan_visible", "kv_e5m2_specials", "kv_int8_extremes", "kv_scale_k_and_v",
    "kv_head_scales_pow2", "kv_token_scales_physical", "kv_e5m2_not_e4m3", "kv_max_code_times_scale",
)


def _params():
    for name in hand_names(kv=True):
        yield pytest.param(name, marks=[pytest.mark.clause(hand_info(name).clause)], id=name)


def _decode(pages, kv_dtype: str, scale, num_pages: int, kv_heads: int, page_size: int) -> np.ndarray:
    """float64 `decode(code) * s` of a code pool, s by the scale's granularity (token
    scales at the physical `[p, g, slot]`); NaN where the code or its token scale is NaN."""
    codes = np.array(pages)
    table = code_values(kv_dtype)
    values = table[codes.view(np.uint8).astype(np.int64)] if kv_dtype == "int8" else table[codes.astype(np.int64)]
    if scale is None:
        return values
    s = np.asarray(scale.tolist() if hasattr(scale, "tolist") else scale, dtype=np.float64)
    granularity = granularity_of(s.shape, num_pages=num_pages, kv_heads=kv_heads, page_size=page_size)
    if granularity == "head":
        s = s[None, :, None, None]
    elif granularity == "token":
        s = s[..., None]
    return values * s


def _dequantized(case):
    """The call over float32 pages holding the dequantized K/V, without kv options."""
    P, Hkv, ps = case.key_pages.shape[:3]
    pools = [mx.array(_decode(pages, case.kv_dtype, scale, P, Hkv, ps).astype(np.float32))
             for pages, scale in ((case.key_pages, case.k_scale), (case.value_pages, case.v_scale))]
    return case.with_(key_pages=pools[0], value_pages=pools[1], kv_dtype=None, k_scale=None, v_scale=None)


def _read_value_scale(case) -> float:
    """max |V| (finite) over the pages the requests read."""
    table, lens = np.array(case.block_table), np.array(case.context_lens)
    pages = sorted({int(p) for b, ctx in enumerate(lens) for p in table[b, :-(-int(ctx) // case.page_size)]})
    return value_scale(case.value_pages[mx.array(pages)]) if pages else 1.0


def _finite_part(x, expected: np.ndarray) -> np.ndarray:
    """x (MLX or NumPy) as float64 at the entries where the hand answer is a number."""
    return np.asarray(to_numpy(x), dtype=np.float64)[~np.isnan(expected)]


def _sdpa_error(deq) -> float | None:
    """SDPA's error against the hand answer on the dequantized call in the query's dtype;
    None where it cannot take the pages exactly in that dtype, or answers NaN / inf at
    an entry the hand answer has a number (a NaN code a masked key holds: 0 * NaN)."""
    pools = [p.astype(deq.dtype) for p in (deq.key_pages, deq.value_pages)]
    for p, p32 in zip(pools, (deq.key_pages, deq.value_pages)):
        if not mx.array_equal(p.astype(mx.float32), p32, equal_nan=True).item():
            return None
    try:
        out = deq.with_(key_pages=pools[0], value_pages=pools[1]).run(oracles.MLX_ORACLES["sdpa"])
    except NotApplicable:
        return None
    error = max_abs_error(_finite_part(out, deq.expected), deq.expected[~np.isnan(deq.expected)])
    return error if np.isfinite(error) else None


def _allowed(case) -> float:
    """The output's allowance against the hand answer (finite entries), on the dequantized call."""
    deq = _dequantized(case)
    want = case.expected[~np.isnan(case.expected)]
    values = _read_value_scale(deq)
    sdpa = _sdpa_error(deq)
    if sdpa is None:
        return allowed_error_unmeasured(case.dtype, want, call_logit_error(deq.args(), deq.kwargs()), values)
    return allowed_error(case.dtype, want, sdpa, values)


def _nan_where_expected(got: np.ndarray, expected: np.ndarray) -> str | None:
    """Why got's NaN entries are not exactly the hand answer's, or None."""
    got_nan, want_nan = np.isnan(got), np.isnan(expected)
    if np.array_equal(got_nan, want_nan):
        return None
    missing, extra = np.argwhere(want_nan & ~got_nan), np.argwhere(got_nan & ~want_nan)
    return (f"NaN expected at {len(missing)} entries and not there (first {missing[:1].tolist()}), "
            f"NaN at {len(extra)} entries expected finite (first {extra[:1].tolist()})")


@pytest.mark.parametrize("name", list(_params()))
def test_kv_hand_fixture(name, attention, error_log):
    """Each quantized fixture: the implementation against the answer derived by hand."""
    info, case = hand_info(name), hand_case(name)
    out = case.run(attention)
    assert out.dtype == DTYPES[hand_spec(name)["dtype"]] == case.dtype, f"{name}: output dtype {out.dtype}"
    assert out.shape == case.query.shape[:3] + case.value_pages.shape[3:], f"{name}: output shape {out.shape}"
    got = to_numpy(out).astype(np.float64)
    nan = np.isnan(case.expected)
    wrong_nan = _nan_where_expected(got, case.expected)
    assert wrong_nan is None, f"{name} ({info.catches}): {wrong_nan}"
    verdict = Verdict(max_abs_error(got[~nan], case.expected[~nan]), _allowed(case), ref_scale(case.expected[~nan]))
    error_log.record(case.dtype, "hand", verdict)
    assert verdict.ok, f"{name} ({info.catches}): {verdict}"
    if info.exact:
        want = mx.array(np.where(nan, 0.0, case.expected).astype(np.float32)).astype(case.dtype)
        masked = mx.where(mx.array(nan), mx.zeros_like(out), out)
        assert bits(masked) == bits(want), (
            f"{name} is exact by its derivation but differs in bits: max error {verdict.error:.3e}")


def _against_reference(name: str, case, ref, who: str) -> None:
    ref = np.asarray(ref, dtype=np.float64)
    wrong_nan = _nan_where_expected(ref, case.expected)
    assert wrong_nan is None, f"{name}: hand answer vs {who}: {wrong_nan}"
    nan = np.isnan(case.expected)
    values = _read_value_scale(_dequantized(case))
    verdict = Verdict(max_abs_error(case.expected[~nan], ref[~nan]), allowed_error(case.dtype, ref[~nan], 0.0, values))
    assert verdict.ok, f"{name}: hand answer vs {who}: {verdict}"


@pytest.mark.parametrize("name", list(_params()))
def test_kv_hand_answer_matches_float64_oracle(name):
    """The hand answer against the float64 oracle on the quantized call (the oracle
    decodes the codes and applies the scales on its own), under the tolerance rule with
    no SDPA term; NaN exactly where the hand answer has it."""
    case = hand_case(name)
    _against_reference(name, case, case.run(oracles.float64), "float64 oracle")


@pytest.mark.parametrize("name", list(_params()))
def test_kv_hand_answer_matches_float64_on_pages_decoded_here(name):
    """The hand arithmetic alone: the float64 oracle on float pages decoded here with the
    fixtures' own code table (so a wrong derivation fails even if the oracle's decoder
    and the hand answer were wrong alike)."""
    case = hand_case(name)
    _against_reference(name, case, _dequantized(case).run(oracles.float64), "float64 on pages decoded here")


def test_kv_catalog_is_complete():
    stems = hand_fixtures(kv=True)
    missing = sorted(set(REQUIRED) - set(stems))
    assert not missing, f"missing quantized fixtures: {missing}"
    names = hand_names(kv=True)
    assert not set(names) & set(hand_names()), "a quantized fixture is in the unquantized catalog"
    assert sorted(names + hand_names()) == sorted(hand_names(kv=None))
    formats, granularities = set(), set()
    for name in names:
        info, case = hand_info(name), hand_case(name)
        assert info.fixture.startswith("kv_") and hand_spec(name)["name"] == info.fixture, name
        assert info.clause == "kv_format", f"{name}: clause {info.clause!r}"
        assert info.catches.strip(), f"{name}: empty 'catches'"
        assert info.derivation and all(line.strip() for line in info.derivation), f"{name}: empty 'derivation'"
        assert info.kv_dtype == case.kv_dtype in KV_DTYPES, name
        formats.add(case.kv_dtype)
        granularities.update(f"{which} {g}" for which, g in zip(
            ("k", "v"), case.pipeline.kv.granularities(num_pages=case.key_pages.shape[0],
                                                       kv_heads=case.key_pages.shape[1], page_size=case.page_size)))
    assert formats == set(KV_DTYPES), formats
    assert granularities >= {f"{w} {g}" for w in "kv" for g in GRANULARITIES}, granularities
    # every query dtype meets every format in some exact fixture
    seen = {(hand_info(n).kv_dtype, hand_spec(n)["dtype"]) for n in names if hand_info(n).exact}
    assert seen >= {(f, d) for f in KV_DTYPES for d in DTYPES}, sorted(seen)


# --- the loader's KV keys ------------------------------------------------------------


def test_codes_and_scales_reach_the_case():
    case = hand_case("kv_e4m3_specials[float16]")
    assert case.kv_dtype == "float8_e4m3fn" and case.key_pages.dtype == mx.uint8 and case.query.dtype == mx.float16
    assert case.k_scale is None and case.v_scale is None
    assert {"kv_dtype"} <= set(case.kwargs()) and not {"k_scale", "v_scale"} & set(case.kwargs())
    v = np.array(case.value_pages)
    assert v[3, 0, 1].tolist() == [0x01, 0x07, 0x08, 0x38, 0x7E, 0xFE, 0x80, 0x87]  # position 1
    assert (v[3, 0, 0] == 0x7F).all() and (np.array(case.key_pages)[3, 0, 0] == 0xFF).all()  # position 0
    poison = np.ones(v.shape, dtype=bool)
    poison[3] = poison[1, :, 0] = False  # written: page 3 and page 1 slot 0
    assert (v[poison] == 0x7F).all() and (np.array(case.key_pages)[poison] == 0x7F).all()
    scaled = hand_case("kv_scale_k_and_v")
    assert scaled.k_scale == 0.25 and scaled.v_scale == 8.0 and isinstance(scaled.k_scale, float)
    heads = hand_case("kv_head_scales_pow2")
    assert heads.k_scale.dtype == mx.float32 and heads.k_scale.tolist() == [1, 8, 0.25, 2]
    assert heads.v_scale.tolist() == [8, 1, 0.125, 4]
    nan = hand_case("kv_e4m3_nan_visible[float32]")
    assert np.isnan(nan.expected[0, 0, 1, 1]) and np.isnan(nan.expected[0, 1, 1]).all()
    assert np.isfinite(nan.expected[0, :, 0]).all()


def test_token_scales_sit_at_the_physical_slot():
    case = hand_case("kv_token_scales_physical")
    spec = hand_spec("kv_token_scales_physical")
    table = spec["requests"][0]["block_table"]
    for key in ("k_scale", "v_scale"):
        s = np.array(getattr(case, key))
        assert getattr(case, key).dtype == mx.float32 and s.shape == (5, 2, 2)
        rows = spec[key]["per_token"][0]
        for g in range(2):
            for j in range(8):
                assert s[table[j // 2], g, j % 2] == rows[g][j], (key, g, j)
        assert np.isnan(s[4]).all() and np.isfinite(s[:4]).all()  # page 4: no request writes it
    assert (np.array(case.key_pages)[4] == -128).all() and (np.array(case.value_pages)[4] == -128).all()
    assert case.key_pages.dtype == mx.int8 and poison_code("int8") == 0x80


BASE = {"name": "tmp", "catches": "-", "clause": "kv_format", "derivation": ["-"], "dtype": "float32",
        "kv_dtype": "int8", "page_size": 2, "num_pages": 3, "max_pages": 1, "q_heads": 2, "kv_heads": 2,
        "head_dim": 1, "scale": 1.0, "mask": "causal", "window": None, "query_len": 1,
        "requests": [{"block_table": [2], "context_len": 2, "keys": {"rule": "zeros"},
                      "values": {"rule": "per_position", "values": [3, 5]}, "query": {"rule": "zeros"},
                      "expected": [[[4]], [[4]]]},
                     {"block_table": [-1], "context_len": 0}]}


def _load(tmp_path, monkeypatch, **changes):
    return load_spec(tmp_path, monkeypatch, spec_with(BASE, **changes))


def test_a_minimal_kv_spec_loads(tmp_path, monkeypatch):
    case = _load(tmp_path, monkeypatch, k_scale=[0.5, 2.0],
                 v_scale={"per_token": [{"rule": "per_head", "values": [0.25, 4]}, None]},
                 r0_expected=[[[4]], [["nan"]]])
    v = np.array(case.value_pages)
    assert v.dtype == np.int8 and v[2, :, :, 0].tolist() == [[3, 5], [3, 5]] and (v[:2] == -128).all()
    assert np.array(case.k_scale).tolist() == [0.5, 2.0]
    s = np.array(case.v_scale)
    assert s.shape == (3, 2, 2) and s[2].tolist() == [[0.25, 0.25], [4, 4]] and np.isnan(s[:2]).all()
    assert case.expected[0, 0, 0, 0] == 4 and np.isnan(case.expected[0, 1, 0, 0])


@pytest.mark.parametrize("changes, message", [
    ({"kv_dtype": "float8_e4m3"}, "kv_dtype 'float8_e4m3' is none of"),
    ({"kv_dtype": None, "v_scale": 2.0}, "v_scale without kv_dtype"),
    ({"r0_values": {"rule": "per_position", "values": [3, 128]}}, "int8 codes are integers in -128..127, got 128"),
    ({"r0_values": {"rule": "per_position", "values": [-129, 0]}}, "int8 codes are integers in -128..127"),
    ({"kv_dtype": "float8_e5m2", "r0_keys": {"rule": "constant", "value": 256}}, "codes are integers in 0..255"),
    ({"kv_dtype": "float8_e4m3fn", "r0_keys": {"rule": "constant", "value": -1}}, "codes are integers in 0..255"),
    ({"r0_values": {"rule": "per_position", "values": [1.5, 2]}}, "codes are integers in -128..127, got 1.5"),
    ({"k_scale": 0.1}, "scales are float32 values > 0, got 0.1"),
    ({"k_scale": -1.0}, "scales are float32 values > 0"),
    ({"v_scale": [1.0]}, "v_scale has 1 entries, expected kv_heads = 2"),
    ({"v_scale": [1.0, 0.0]}, "scales are float32 values > 0"),
    ({"v_scale": {"per_token": [[[1, 1], [1, 1]]]}}, "per_token has 1 entries, expected one per request (2)"),
    ({"v_scale": {"per_token": [[[1, 1, 1], [1, 1, 1]], None]}}, "has shape (2, 3), expected (2, 2)"),
    ({"v_scale": {"per_token": [None, None]}}, "a live request needs its scales"),
    ({"v_scale": {"per_token": [[[1, 1], [1, 1]], [[1]]]}}, "an empty slot has no scales"),
    ({"v_scale": {"tokens": 1}}, 'a number, a list of Hkv numbers or {"per_token": ...}'),
    ({"r0_expected": [[[4]], [[None]]]}, 'entries are numbers or the string "nan"'),
])
def test_malformed_kv_keys_are_refused(tmp_path, monkeypatch, changes, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        _load(tmp_path, monkeypatch, **changes)


def test_a_shared_page_with_two_token_scales_is_refused(tmp_path, monkeypatch):
    """Two requests writing the same slot must agree on its codes and on its token scale."""
    shared = {"block_table": [2], "context_len": 2, "keys": {"rule": "zeros"},
              "values": {"rule": "per_position", "values": [3, 5]}, "query": {"rule": "zeros"},
              "expected": [[[4]], [[4]]]}
    spec = spec_with(BASE, requests=[shared, shared], v_scale={"per_token": [[[1, 1], [1, 1]], [[1, 1], [1, 2]]]})
    with pytest.raises(ValueError, match=re.escape("rewrites the v_scale of page 2 slot 1")):
        load_spec(tmp_path, monkeypatch, spec)
    spec["v_scale"] = {"per_token": [[[1, 1], [1, 2]], [[1, 1], [1, 2]]]}
    assert np.array(load_spec(tmp_path, monkeypatch, spec).v_scale)[2].tolist() == [[1, 1], [1, 2]]


def test_storage_dtypes_follow_the_contract():
    for name in hand_names(kv=True):
        case = hand_case(name)
        assert str(case.key_pages.dtype).removeprefix("mlx.core.") == storage_dtype(case.kv_dtype), name
        assert case.value_pages.dtype == case.key_pages.dtype, name
