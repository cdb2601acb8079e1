"""Declarations narrow what is checked; they never fail a check (issue 19, point 3).

| check                                     | what it proves                                        |
|-------------------------------------------|-------------------------------------------------------|
| `layouts(caps)` within the declaration    | every drawn layout is a call the declaration covers (dtype, D, page size, L, mask, window) |
| `layouts(caps)` covers the declaration    | each declared head dim and page size is drawn; small pages still give multi-page rows with tails and empty slots; large pages two-page rows |
| `layouts(caps, kind)`                     | a rejection kind always gets a layout it can break     |
| `ruled_out`                               | nothing to draw, or a kind needing L >= 2 without prefill: the reason |
| a narrow kernel runs tests/test_properties.py | exit 0, no FailedHealthCheck, the property checks passed (child pytest) |
| a check ruled out everywhere              | exactly one skip with the reason (child pytest)        |
| fixtures/memory.py                        | MemAvailable parsed in bytes, sysconf fallbacks, the comparison, the need |
| a kernel declaring a huge `extra_memory`  | the 2^31-offset fixture skipped with the memory reason, its 4 GiB pool never built (child pytest) |
| an undeclared contract-v2 feature         | each call using it (soft-cap, ALiBi, sinks, lse, Dv != Dk) skipped with `FEATURE (declare FEATURE=True in pagecheck_capabilities)`, directly, through `require_case`, for packed calls and in the catalog (child pytest, the report's per-feature counts) |

The child runs use `run_catalog` of tests/test_plugin.py (a user's `pytest --impl`).
"""

from __future__ import annotations

import resource
import sys

import mlx.core as mx
import pytest
from hypothesis import Phase, find, given, settings
from hypothesis import strategies as st

from conformance import Capabilities, load
from conformance.capabilities import FEATURE_KEYS, features_in
from contract import ScorePipeline
from fixtures import memory, paged_case
from fixtures.memory import GiB, need_bytes, pool_bytes, shortfall
from fixtures.strategies import REJECTION_NEEDS, applicable, layouts, ruled_out
from tests.plugin_impls import NARROW
from tests.test_plugin import run_catalog

DECLARATIONS = {
    "everything": {},
    "narrow": NARROW,  # vLLM-CPU-like: f32/f16, head dims 32..256, pages in multiples of 16
    "listed_pages_decode": {"dtypes": ["bfloat16"], "page_sizes": [3, 5, 200], "prefill": False,
                            "window": False, "unmasked": False},
    "multiple_of_48": {"block_multiple": 48, "head_dims": [7]},
    "vllm_split": {"layout": "vllm_split"},  # D in chunks of 16 bytes: the head dims depend on the dtype
}
PROPERTIES = "tests/test_properties.py"


def _caps(name: str) -> Capabilities:
    return Capabilities.declared(DECLARATIONS[name])


def _outside(caps: Capabilities, layout: dict) -> str | None:
    case = paged_case(**layout)  # the call's score pipeline and value pool, as the check makes them
    return caps.unsupported(dtype=layout["dtype"], head_dim=layout["head_dim"], page_size=layout["page_size"],
                            query_len=layout["query_len"], pipeline=case.pipeline,
                            value_head_dim=case.value_pages.shape[-1])


# -- layouts(caps) -----------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(DECLARATIONS))
@settings(max_examples=4 * settings.default.max_examples)
@given(data=st.data())
def test_every_drawn_layout_is_within_the_declaration(name, data):
    caps = _caps(name)
    layout = data.draw(layouts(caps), label="layout")
    assert _outside(caps, layout) is None
    assert all(c == 0 or c >= layout["query_len"] for c in layout["context_lens"])


def _drawn(caps: Capabilities | None, n: int = 300) -> list[dict]:
    """n layouts as hypothesis generates them for a check (no shrinking: it is the spread
    that is looked at, and `find` would shrink each hit)."""
    seen = []

    @settings(max_examples=n, phases=[Phase.generate], database=None, derandomize=True)
    @given(layouts(caps))
    def collect(layout):
        seen.append(layout)

    collect()
    return seen


@pytest.mark.parametrize("name,sizes", [
    ("narrow", [16, 32, 48, 64, 128, 256]),
    ("multiple_of_48", [48, 144, 288]),   # large pages: the first multiples from 128 and 256
    ("listed_pages_decode", [3, 5, 200]),
])
def test_every_declared_head_dim_and_page_size_is_drawn(name, sizes):
    """Narrowing must not lose the declaration's far end (D 256, large pages): nothing
    outside the declaration is drawn, and every declared value can be. The spread of
    300 draws is not a fixed thing (hypothesis biases its draws with constants found in
    the modules loaded, so the suite around a test changes them): a declared value the
    spread missed is searched for on its own."""
    caps = _caps(name)
    drawn = _drawn(caps)
    pages, dims = {layout["page_size"] for layout in drawn}, {layout["head_dim"] for layout in drawn}
    assert pages <= set(sizes) and (caps.head_dims is None or dims <= set(caps.head_dims))
    search = settings(max_examples=3000, phases=[Phase.generate], database=None)
    for key, value in [("page_size", v) for v in sorted(set(sizes) - pages)] + \
                      [("head_dim", v) for v in sorted(set(caps.head_dims or ()) - dims)]:
        find(layouts(caps), lambda layout: layout[key] == value, settings=search)  # NoSuchExample: never drawn
    if not caps.head_dims:  # the 1..64 range, spread (hypothesis repeats values: not every one in 300 draws)
        assert dims <= set(range(1, 65)) and len(dims) >= 16, sorted(dims)


@pytest.mark.parametrize("page_size", [16, 32, 256])
def test_declared_pages_still_give_multi_page_rows_tails_and_empty_slots(page_size):
    def rich(layout) -> bool:
        lens = layout["context_lens"]
        return 0 in lens and any(c > page_size and c % page_size for c in lens)

    caps = Capabilities.declared({"page_sizes": [page_size], "block_multiple": 16})
    assert sum(map(rich, _drawn(caps))) >= 5


def test_prefill_window_and_unmasked_are_drawn_where_declared():
    drawn = _drawn(None)
    assert any(layout["query_len"] > 8 and layout["window"] is not None for layout in drawn)
    assert any(layout["mask"] is None for layout in drawn)


@pytest.mark.parametrize("kind", sorted(REJECTION_NEEDS))
@settings(max_examples=settings.default.max_examples)
@given(data=st.data())
def test_a_rejection_kind_gets_a_layout_it_can_break(kind, data):
    caps = _caps("narrow")
    layout = data.draw(layouts(caps, kind), label="layout")
    assert _outside(caps, layout) is None
    assert kind in applicable(paged_case(**layout))


def test_ruled_out_names_why():
    assert all(ruled_out(_caps(name)) is None for name in DECLARATIONS)
    assert ruled_out(None) is None and ruled_out(None, "context_short") is None
    decode = Capabilities.declared({"prefill": False})
    assert ruled_out(decode, "context_short") == "context_short needs L >= 2 (declared prefill=False)"
    assert ruled_out(decode, "page_id_high") is None
    # vllm_split cuts D into 16-byte chunks: head dim 4 fits float32 (x = 4), never float16 (x = 8)
    split = Capabilities.declared({"layout": "vllm_split", "dtypes": ["float16"], "head_dims": [4]})
    reason = ruled_out(split)
    assert reason.startswith("no declared dtype fits: float16: head dim 4") and "vllm_split" in reason
    with pytest.raises(ValueError, match="nothing to draw: no declared dtype fits"):
        find(layouts(split), lambda layout: True)
    split32 = Capabilities.declared({"layout": "vllm_split", "dtypes": ["float16", "float32"], "head_dims": [4]})
    assert find(layouts(split32), lambda layout: True)["dtype"] == "float32"


# -- a narrow kernel through the property checks (child pytest) --------------------------

def _by_outcome(record: dict, outcome: str) -> list[dict]:
    return [c for c in record["checks"] if c["outcome"] == outcome]


@pytest.mark.parametrize("impl,skipped_because", [
    ("float64_oracle_narrow", "validates_input"),  # the oracle does not validate: rejections skipped as declared
    ("builtin_narrow", None),                      # a validating kernel: every property check runs
])
def test_narrow_declaration_passes_the_property_checks(impl, skipped_because, tmp_path):
    proc, record = run_catalog(f"tests.plugin_impls:{impl}", tmp_path, [PROPERTIES])
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "FailedHealthCheck" not in proc.stdout and not _by_outcome(record, "failed")
    passed = {c["id"].split("::")[1].split("[")[0] for c in _by_outcome(record, "passed")}
    assert {"test_kernel_matches_float64_oracle", "test_batch_and_schedule_invariance",
            "test_unread_table_entries_are_neither_checked_nor_read"} <= passed, passed
    skips = {c["message"] for c in _by_outcome(record, "skipped")}
    if skipped_because:
        assert all(skipped_because in m for m in skips), skips
    else:
        assert not skips and "test_rejected_metadata_raises_before_computing" in passed, skips


def test_a_check_ruled_out_everywhere_is_one_skip_with_the_reason(tmp_path):
    proc, record = run_catalog("tests.plugin_impls:builtin_decode_only", tmp_path, [PROPERTIES])
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "FailedHealthCheck" not in proc.stdout and not _by_outcome(record, "failed")
    reason = ("not declared by tests.plugin_impls:builtin_decode_only: "
              "context_short needs L >= 2 (declared prefill=False)")
    ruled = [c["id"] for c in _by_outcome(record, "skipped") if c["message"] == reason]
    assert ruled == [f"{PROPERTIES}::test_rejected_metadata_raises_before_computing[context_short]"], \
        [(c["id"], c["message"]) for c in _by_outcome(record, "skipped")]
    rejections = [c for c in _by_outcome(record, "passed") if "test_rejected_metadata" in c["id"]]
    assert len(rejections) == 7  # every other kind ran


# -- fixtures/memory.py ------------------------------------------------------------------

def test_meminfo_is_read_in_bytes(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24683584 kB\nMemFree:  100 kB\nMemAvailable:   2097152 kB\n")
    assert memory.available_bytes(meminfo) == 2 * GiB


def test_without_meminfo_sysconf_is_asked(tmp_path, monkeypatch):
    pages = {"SC_AVPHYS_PAGES": 1024, "SC_PHYS_PAGES": 4096, "SC_PAGE_SIZE": 4096}
    monkeypatch.setattr(memory.os, "sysconf", lambda name: pages[name])
    assert memory.available_bytes(tmp_path / "absent") == 1024 * 4096  # free pages first

    def macos(name):  # no SC_AVPHYS_PAGES there: all physical pages
        if name == "SC_AVPHYS_PAGES":
            raise ValueError("unrecognized configuration name")
        return pages[name]

    monkeypatch.setattr(memory.os, "sysconf", macos)
    assert memory.available_bytes(tmp_path / "absent") == 4096 * 4096


def test_shortfall_compares_need_with_what_is_available(monkeypatch):
    assert shortfall(3 * GiB, 2 * GiB) == "needs 3.0 GiB, 2.0 GiB available"
    assert shortfall(2 * GiB, 2 * GiB) is None and shortfall(GiB, 2 * GiB) is None
    monkeypatch.setattr(memory, "available_bytes", lambda: None)
    assert shortfall(10 ** 18) is None  # unknown: the check runs


def test_need_counts_the_declared_extra_memory_of_both_pool_inputs():
    geometry = dict(num_pages=1048578, kv_heads=1, page_size=16, head_dim=128, dtype="bfloat16")
    built, inputs = pool_bytes(**geometry, pools=1), pool_bytes(**geometry)
    assert built == (2 ** 31 + 4096) * 2 and inputs == 2 * built
    assert need_bytes(built=built, inputs=inputs, extra_memory=0.0, working_set=5) == built + 5
    assert need_bytes(built=built, inputs=inputs, extra_memory=4.0) == built + 4 * inputs


# -- the 2^31 fixture for a kernel that may allocate a million pools (child pytest) ------

def _peak_child_rss() -> int:
    """The largest resident set of any finished child process so far, in bytes."""
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def test_a_fixture_that_cannot_fit_is_skipped_before_it_is_built(tmp_path):
    before = _peak_child_rss()
    # the later -m wins over run_catalog's "not slow": the 2^31 fixture is marked slow
    proc, record = run_catalog("tests.plugin_impls:builtin_huge_extra_memory", tmp_path,
                               ["-m", "correctness", "-k", "page_offset_past_2_31", "tests/test_hand_fixtures.py"])
    assert proc.returncode == 0, proc.stdout[-4000:]
    [check] = record["checks"]
    assert check["id"] == "tests/test_hand_fixtures.py::test_hand_fixture[page_offset_past_2_31]"
    assert check["outcome"] == "skipped", check
    assert "does not fit in memory" in check["message"] and "GiB available" in check["message"]
    assert "extra_memory 1e+06" in check["message"], check["message"]
    after = _peak_child_rss()
    # the pool is 4 GiB: a child that built it would have raised the peak past 4 GiB
    assert after == before or after < 4 * GiB, f"the child peaked at {after / GiB:.1f} GiB"


# -- contract v2: an undeclared feature is a skip with the reason, never a failure ------

V2_CALLS = {  # feature -> what a call using it changes
    "softcap": dict(softcap=30.0),
    "alibi": dict(alibi_slopes=mx.array([0.5, 0.25, 0.125, 0.0625])),
    "sinks": dict(sinks=mx.array([0.0, 1.0, -1.0, 2.0])),
    "lse": dict(return_lse=True),
}


def _v2_case(feature: str):
    case = paged_case(context_lens=[9, 0, 6], query_len=2, q_heads=4, kv_heads=2, head_dim=8, page_size=4, seed=5)
    if feature == "value_head_dim":
        return case.with_(value_pages=case.value_pages[..., :5])  # Dv = 5 != Dk = 8
    return case.with_(**V2_CALLS[feature])


def _skip_reason(fn, *args, **kwargs) -> str:
    with pytest.raises(pytest.skip.Exception) as skipped:
        fn(*args, **kwargs)
    return skipped.value.msg


@pytest.mark.parametrize("feature", FEATURE_KEYS)
def test_an_undeclared_v2_feature_is_skipped_with_the_reason(feature):
    impl = load("tests.plugin_impls:float64_oracle")  # declares none of contract v2
    case = _v2_case(feature)
    detail = "Dv = 5 != Dk = 8; " if feature == "value_head_dim" else ""
    want = (f"not declared by tests.plugin_impls:float64_oracle: {feature} ({detail}declare {feature}=True "
            f"in pagecheck_capabilities)")
    assert _skip_reason(case.run, impl) == want
    assert _skip_reason(impl.require_case, case) == want  # checks calling attention.fn directly
    assert not impl.supports(case)
    assert features_in(want) == (feature,)
    assert _skip_reason(impl.require, feature) == (f"not declared by tests.plugin_impls:float64_oracle: {feature} "
                                                   f"(declare {feature}=True in pagecheck_capabilities)")
    # declared: the same call runs (the float64 oracle computes all of contract v2)
    declared = load("tests.plugin_impls:float64_oracle_v2")
    assert declared.supports(case) and declared.caps.features() == FEATURE_KEYS
    result = case.run(declared)
    assert isinstance(result, tuple) == (feature == "lse")


def test_a_call_lacking_several_features_names_each():
    caps = Capabilities.declared({"softcap": True})
    pipeline = ScorePipeline(softcap=1.0, sinks=mx.zeros(4), alibi_slopes=mx.zeros(4), return_lse=True)
    reason = caps.unsupported(dtype="float32", head_dim=8, page_size=4, query_len=1, pipeline=pipeline,
                              value_head_dim=4)
    assert reason == ("alibi, sinks, lse, value_head_dim (Dv = 4 != Dk = 8; declare alibi=True, sinks=True, "
                      "lse=True, value_head_dim=True in pagecheck_capabilities)")
    assert features_in(reason) == ("alibi", "sinks", "lse", "value_head_dim")
    assert features_in("dtype bfloat16 (declared dtypes: float32)") == ()
    # shape rules come first; Dv == Dk is no feature
    assert caps.unsupported(dtype="float32", head_dim=8, page_size=4, query_len=1, pipeline=ScorePipeline(),
                            value_head_dim=8) is None
    narrow = Capabilities.declared({"dtypes": ["float32"]})
    assert narrow.unsupported(dtype="bfloat16", head_dim=8, page_size=4, query_len=1,
                              pipeline=pipeline).startswith("dtype bfloat16")


def test_an_unknown_keyword_is_the_kernels_error_not_a_skip():
    impl = load("tests.plugin_impls:float64_oracle")
    case = _v2_case("lse")
    assert impl.unsupported(*case.args(), logits_soft_cap=30.0) is None  # the call itself raises TypeError
    with pytest.raises(TypeError, match="logits_soft_cap"):
        impl(*case.args(), logits_soft_cap=30.0)


def test_builtin_declares_all_of_contract_v2():
    assert load(None).caps.features() == FEATURE_KEYS
    assert Capabilities.declared(None).features() == ()
    assert Capabilities.declared({"sinks": True, "lse": True}).features() == ("sinks", "lse")


def test_mixed_lengths_with_an_undeclared_feature_are_skipped():
    import dataclasses

    from fixtures.mixed import mixed_case

    impl = load("tests.format_impls:kv_last_varlen")  # varlen, no v2 feature declared
    mixed = mixed_case(context_lens=[9, 14], query_lens=[1, 5], q_heads=4, kv_heads=2, head_dim=8, page_size=4)
    with_sinks = dataclasses.replace(mixed, base=mixed.base.with_(sinks=mx.zeros(4)))
    assert _skip_reason(impl.packed, with_sinks).endswith("sinks (declare sinks=True in pagecheck_capabilities)")
    assert impl.packed(mixed).shape == mixed.query.shape


def test_an_undeclared_kernel_gets_each_v2_hand_fixture_skipped_with_the_reason(tmp_path):
    """The catalog on the float64 oracle declaring nothing of contract v2 (a child pytest):
    every hand fixture using a v2 feature is a skip naming it, none fails, and the report
    counts the skips per feature."""
    from fixtures.hand import hand_case, hand_names

    uses = {}
    for name in hand_names():
        case = hand_case(name)
        used = set(case.pipeline.features())
        if case.value_pages.shape[-1] != case.key_pages.shape[-1]:
            used.add("value_head_dim")
        if used:
            uses[name] = used
    assert uses, "the hand catalog has no contract-v2 fixture"
    proc, record = run_catalog("tests.plugin_impls:float64_oracle", tmp_path,
                               ["tests/test_hand_fixtures.py::test_hand_fixture"])
    checks = {c["id"]: c for c in record["checks"]}
    for name, used in uses.items():
        check = checks[f"tests/test_hand_fixtures.py::test_hand_fixture[{name}]"]
        assert check["outcome"] == "skipped", check
        assert check["message"].startswith("not declared by tests.plugin_impls:float64_oracle: ")
        assert set(features_in(check["message"])) == used, (name, check["message"])
    assert proc.returncode == 0, proc.stdout[-4000:]
    for feature in FEATURE_KEYS:
        assert record["features"][feature] == {"declared": False,
                                               "skipped": sum(feature in u for u in uses.values())}
    md = (tmp_path / "conformance.md").read_text()
    assert "## Contract v2 features" in md and "contract v2 features declared: none" in md


def test_a_malformed_head_dim_is_a_rejection_not_a_value_head_dim_skip():
    impl = load("tests.plugin_impls:float64_oracle")
    case = _v2_case("value_head_dim")
    assert not impl.supports(case)
    short_query = case.with_(query=case.query[..., :4], value_pages=case.key_pages)  # query D 4, Dk = Dv = 8
    assert impl.unsupported(*short_query.args(), **short_query.kwargs()) is None
