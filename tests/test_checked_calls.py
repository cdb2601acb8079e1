"""The serving call's checks remembered on its `PagedMetadata` (impl/checked.py): a call
with the signature of one that passed skips them, and must get exactly what running them
would give.

| what must hold                                                                   | test                                        |
|----------------------------------------------------------------------------------|---------------------------------------------|
| a repeated call runs no check; another metadata checks again                      | test_a_repeated_call_is_not_checked_again   |
| after calls that passed, each variant gets a fresh metadata's verdict: the same error, or the same bits (an array option's values are this call's) | test_remembered_checks_give_the_fresh_verdict |
| the key tells apart what compares equal (True / 1 / 1.0, 0.0 / -0.0) and leaves out what it cannot state | test_signature_states_what_the_checks_read |
| the memo holds at most MEMO_LIMIT signatures per metadata                         | test_memo_is_bounded                        |
| checked, remembered or not, a serving call gives the contract call's bits (every option reaches the kernel) | test_serving_calls_give_the_contract_bits |
| the memo holds none of the caller's arrays: a pool's token scales are still written in place | test_memo_pins_no_pool_state |
| the contract entry point (`paged_attention`, "contract" below) remembers its array and option checks process-wide; each variant of its metadata gets the fresh verdict | test_remembered_checks_give_the_fresh_verdict, test_contract_metadata_variants_give_the_fresh_verdict |
| a repeated contract call skips those checks, never the metadata's dtypes and values | test_a_repeated_contract_call_checks_only_the_metadata |
| the contract memo keys its metadata's types, shapes, dtypes and page_size's type, and drops its oldest past CONTRACT_LIMIT | test_contract_signature_states_what_the_checks_read, test_contract_memo_drops_the_oldest |
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest

import impl
from impl import checked
from fixtures.serving import make_pool, pool_rows
from impl.pool import pool_copies
from tests.bitwise import result_bits
from tests.test_now import _call

pytestmark = [pytest.mark.correctness, pytest.mark.builtin_only("the built-in serving path's remembered checks")]



def _contract(query, key_pages, value_pages, meta, **kwargs):
    """The contract entry point on the metadata's arrays (every value checked per call)."""
    return impl.paged_attention(query, key_pages, value_pages, meta.block_table, meta.context_lens, meta.page_size,
                                **kwargs)


ENTRIES = {"lazy": impl.paged_attention_with_metadata, "now": impl.paged_attention_now, "contract": _contract}
SERVING = ("lazy", "now")  # the entries that remember on the metadata


def _forgetting(entry, meta):
    """A metadata with nothing remembered; for the contract entry, an empty process memo."""
    if entry == "contract":
        checked._contract_memo.clear()
    return dataclasses.replace(meta)


def _base(name):
    """(query, pools, metadata, kwargs): an f32 decode with every v2 option as an array or a
    scalar ("v2"), or int8 pages with token scales ("int8")."""
    if name == "int8":
        case, meta, kwargs, pools = _call("decode-int8-token-scales")
        return case.query, pools, meta, kwargs
    case, meta, kwargs, pools = _call("decode-f32-gqa-empty-slot")
    rng = np.random.default_rng(11)
    kwargs.update(softcap=25.0, return_lse=True, sinks=mx.array(rng.normal(size=4).astype(np.float32)),
                  alibi_slopes=mx.array(rng.uniform(0.01, 0.2, size=4).astype(np.float32)))
    return case.query, pools, meta, kwargs


def _other_values(x):
    """An array of x's shape and dtype holding other values."""
    return mx.array(np.array(x) * 1.5 + 0.25)


def _outcome(entry, query, pools, meta, kwargs):
    """What one call gives: its error (type, clause, message) or its result's bits."""
    try:
        out = entry(query, *pools, meta, **kwargs)
        mx.eval(out)
    except Exception as err:  # noqa: BLE001 - any error must be the one a fresh metadata gives
        return ("raised", type(err).__name__, getattr(err, "clause", None), str(err))
    return ("computed", result_bits(out))


# name -> (base, calls made first with the same metadata, the probe); each call a change of
# the base call: keyword arguments, or "query" / "pools" transforms.
VARIANTS = {
    "same call": ("v2", [], {}),
    "return_lse 1 after True": ("v2", [], dict(return_lse=1)),
    "scale True after 1": ("v2", [dict(scale=1)], dict(scale=True)),
    "scale 1.0 after 1": ("v2", [dict(scale=1)], dict(scale=1.0)),
    "scale -0.0 after 0.0": ("v2", [dict(scale=0.0)], dict(scale=-0.0)),
    "scale as numpy after float": ("v2", [dict(scale=0.5)], dict(scale=np.float32(0.5))),
    "window 2.0 after 2": ("v2", [dict(window=2)], dict(window=2.0)),
    "softcap 0 after 25": ("v2", [], dict(softcap=0.0)),
    "sinks of other values": ("v2", [], dict(sinks=_other_values)),
    "alibi of other values": ("v2", [], dict(alibi_slopes=_other_values)),
    "sinks one longer": ("v2", [], dict(sinks=lambda x: mx.concatenate([x, x[:1]]))),
    "sinks float16": ("v2", [], dict(sinks=lambda x: x.astype(mx.float16))),
    "sinks as numpy": ("v2", [], dict(sinks=lambda x: np.array(x))),
    "numpy sinks after numpy sinks": ("v2", [dict(sinks=lambda x: np.array(x))],
                                      dict(sinks=lambda x: np.array(x) * 2)),
    "numpy sinks, then a bfloat16 query with numpy sinks": ("v2", [dict(sinks=lambda x: np.array(x))], dict(
        sinks=lambda x: np.array(x), query=lambda q: q.astype(mx.bfloat16))),
    "no mask": ("v2", [], dict(mask=None)),
    "packed layout on float32": ("v2", [], dict(kv_layout="amx_packed")),
    "k_scale without kv_dtype": ("v2", [], dict(k_scale=0.5)),
    "query bfloat16": ("v2", [], dict(query=lambda q: q.astype(mx.bfloat16))),
    "query of two rows": ("v2", [], dict(query=lambda q: mx.concatenate([q, q], axis=2))),
    "query as numpy": ("v2", [], dict(query=np.array)),
    "pools one page short": ("v2", [], dict(pools=lambda p: tuple(x[:-1] for x in p))),
    "pools float16": ("v2", [], dict(pools=lambda p: tuple(x.astype(mx.float16) for x in p))),
    "k_scale of other values": ("int8", [], dict(k_scale=_other_values)),
    "v_scale of other values": ("int8", [], dict(v_scale=_other_values)),
    "k_scale per head": ("int8", [], dict(k_scale=lambda x: mx.ones((x.shape[1],), dtype=mx.float32))),
    "v_scale scalar after scalar": ("int8", [dict(v_scale=0.01)], dict(v_scale=0.02)),
    "kv_dtype float8 on int8 codes": ("int8", [], dict(kv_dtype="float8_e4m3fn")),
}


def _changed(query, pools, kwargs, change):
    """The base call with `change` applied (callables map the base's value)."""
    kwargs = dict(kwargs)
    for name, value in change.items():
        if name == "query":
            query = value(query)
        elif name == "pools":
            pools = value(pools)
        else:
            kwargs[name] = value(kwargs[name]) if callable(value) else value
    return query, pools, kwargs


@pytest.mark.parametrize("entry", sorted(ENTRIES))
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_remembered_checks_give_the_fresh_verdict(variant, entry):
    """The base call and the warm-up calls pass with one metadata; then the probe, twice, must
    give what it gives on a fresh metadata (nothing remembered): the same error, or the
    same bits. A remembered array option would give the base's bits; a key that took
    True for 1 would compute what must raise."""
    base, warm, probe = VARIANTS[variant]
    call = ENTRIES[entry]
    query, pools, meta, kwargs = _base(base)
    q, p, kw = _changed(query, pools, kwargs, probe)
    expected = _outcome(call, q, p, _forgetting(entry, meta), kw)
    _forgetting(entry, meta)  # the probe's own verdict is not among those remembered
    for change in [{}, *warm]:
        wq, wp, wkw = _changed(query, pools, kwargs, change)
        assert _outcome(call, wq, wp, meta, wkw)[0] == "computed"
    assert _outcome(call, q, p, meta, kw) == expected
    assert _outcome(call, q, p, meta, kw) == expected


def _count_calls(monkeypatch, name) -> list:
    """The argument tuples of every call of impl.checked's `name` from here on."""
    real, ran = getattr(checked, name), []

    def counted(*args):
        ran.append(args)
        return real(*args)

    monkeypatch.setattr(checked, name, counted)
    return ran


def test_a_repeated_call_is_not_checked_again(monkeypatch):
    """Every layer of a step after the first skips the checks; each metadata (a step)
    checks its first call."""
    ran = _count_calls(monkeypatch, "check_call")
    query, pools, meta, kwargs = _base("v2")
    first = result_bits(impl.paged_attention_now(query, *pools, meta, **kwargs))
    for _ in range(3):
        assert result_bits(impl.paged_attention_now(query, *pools, meta, **kwargs)) == first
        assert result_bits(impl.paged_attention_with_metadata(query, *pools, meta, **kwargs)) == first
    assert len(ran) == 1 and len(meta.checked) == 1
    impl.paged_attention_now(query, *pools, dataclasses.replace(meta), **kwargs)
    assert len(ran) == 2


def test_signature_states_what_the_checks_read():
    query, pools, meta, kwargs = _base("v2")
    options = dict.fromkeys(checked.OPTIONS + ("kv_layout",))

    def key(q=query, **change):
        return checked.signature(q, *pools, tuple({**options, **change}.values()))

    assert key() == key() and key() is not None
    assert len({key(scale=True), key(scale=1), key(scale=1.0)}) == 3
    assert len({key(return_lse=True), key(return_lse=1)}) == 2
    assert key(scale=-0.0) is None and key(scale=0.0) is None and key(scale=0) is not None
    assert key(sinks=mx.zeros((4,))) == key(sinks=mx.ones((4,)))  # the checks read no values
    assert key(sinks=mx.zeros((4,))) != key(sinks=mx.zeros((5,))) != key(sinks=mx.zeros((5,), mx.float16))
    assert key(sinks=np.zeros(4, np.float32)) is None and key(scale=np.float32(0.5)) is None
    assert key(q=np.array(query)) is None and key(q=query.astype(mx.bfloat16)) != key()
    for i in range(2):  # either pool not an mx.array: checked every time
        arrays = [query, *pools]
        arrays[1 + i] = np.array(arrays[1 + i])
        assert checked.signature(*arrays, tuple(options.values())) is None
    assert key(scale=0.5) is not None and key(scale=0.5) != key(scale=0.25)
    # Each array's shape and dtype: a page fewer, other pool dtypes, another query length.
    assert len({checked.signature(query, *(x[:-1] for x in pools), tuple(options.values())),
                checked.signature(query, *(x.astype(mx.float16) for x in pools), tuple(options.values())),
                checked.signature(query, pools[0], pools[1][:-1], tuple(options.values())),
                key(q=mx.concatenate([query, query], axis=2)), key()}) == 5
    # An array option's dims are keyed with their count: no two of these shapes share a key.
    shapes = [(4,), (1, 4), (4, 1), (2, 2), (2, 2, 1), (16,)]
    assert len({key(sinks=mx.zeros(s)) for s in shapes}) == len(shapes)
    # Two calls whose arrays' dims and dtypes would run together into the same words
    # without the dim counts (float32 is dtype 10 in MLX, int8 5, an array option type 5).
    assert (key(alibi_slopes=mx.zeros((4,)), sinks=mx.zeros((5, 4)))
            != key(alibi_slopes=mx.zeros((4, 10), mx.int8), sinks=mx.zeros((4,))))
    assert checked.signature(query, *pools, list(options.values())) is None  # options come as a tuple


def test_memo_is_bounded():
    query, pools, meta, kwargs = _base("v2")
    outs = {}
    for i in range(checked.MEMO_LIMIT + 8):
        scale = 0.1 + i / 64
        outs[scale] = result_bits(impl.paged_attention_now(query, *pools, meta, **{**kwargs, "scale": scale}))
    assert len(meta.checked) == checked.MEMO_LIMIT
    for scale, bits in outs.items():  # remembered or not, each call gives its own result
        assert result_bits(impl.paged_attention_now(query, *pools, meta, **{**kwargs, "scale": scale})) == bits


@pytest.mark.parametrize("entry", SERVING)
@pytest.mark.parametrize("base,change", [
    ("v2", {}), ("v2", dict(scale=0.3, window=3)), ("v2", dict(mask=None, return_lse=False)),
    ("int8", {}), ("int8", dict(k_scale=0.02, v_scale=0.01)), ("int8", dict(return_lse=True)),
])
def test_serving_calls_give_the_contract_bits(base, change, entry):
    """The serving call's checks (run, then remembered) hand the kernel every option as the
    contract entry point's own checks do: the same bits, first call and repeated."""
    query, pools, meta, kwargs = _base(base)
    kwargs = {**kwargs, **change}
    expected = result_bits(impl.paged_attention(query, *pools, meta.block_table, meta.context_lens, meta.page_size,
                                                **kwargs))
    for _ in range(2):
        assert result_bits(ENTRIES[entry](query, *pools, meta, **kwargs)) == expected


@pytest.mark.parametrize("entry", sorted(ENTRIES))
def test_memo_pins_no_pool_state(entry):
    """A layer's token scales are pool state, written in place (impl/pool.py): a memo
    holding the array a call passed would be one more reference to it, and the next
    write would copy the layer's scales every step instead."""
    pool = make_pool(kv_dtype="int8", scales="token", num_layers=1, page_size=16, head_dim=32, num_pages=8)
    pool.allocate(2)
    pool.write(0, range(20), pool_rows(pool, 20, seed=1), pool_rows(pool, 20, seed=2))
    meta = impl.PagedMetadata.build(mx.array([[0, 1]], dtype=mx.int32), mx.array([20], dtype=mx.int32),
                                    page_size=16, num_pages=8, query_len=1)
    query = mx.array(np.random.default_rng(3).standard_normal((1, 4, 1, 32)).astype(np.float32))
    for step in range(3):
        out = ENTRIES[entry](query, pool.keys(0), pool.values(0), meta, **pool.kv_options(0))
        mx.eval(out)
        del out
        copies = pool_copies()
        pool.write(0, [20 + step], pool_rows(pool, 1, seed=9 + step), pool_rows(pool, 1, seed=20 + step))
        mx.eval(pool.keys(0), pool.values(0), *pool.kv_options(0).values())
        assert pool_copies() == copies, f"step {step}: the write copied the layer"
    assert len(meta.checked) == (entry in SERVING)


def _two_rows(x):
    """The array with its first row repeated (a table or lengths one request longer)."""
    return mx.concatenate([x, x[:1]])


# name -> (change of the metadata's (block_table, context_lens, page_size)); the contract
# entry point reads them as arguments, so its memo key must state them.
METADATA_VARIANTS = {
    "same metadata": {},
    "table and lengths one request longer": dict(block_table=_two_rows, context_lens=_two_rows),
    "table one column wider": dict(block_table=lambda t: mx.concatenate([t, t[:, :1]], axis=1)),
    "table int64": dict(block_table=lambda t: t.astype(mx.int64)),
    "lengths as numpy": dict(context_lens=np.array),
    "a page outside the pool": dict(block_table=lambda t: mx.full(t.shape, 10 ** 6, dtype=mx.int32)),
    "page_size 16.0 after 16": dict(page_size=float),
    "page_size numpy int": dict(page_size=np.int64),
    "page_size True": dict(page_size=lambda _: True),
}


@pytest.mark.parametrize("variant", sorted(METADATA_VARIANTS))
def test_contract_metadata_variants_give_the_fresh_verdict(variant):
    """After the base call passed (and was remembered), a call with other metadata gets
    what it gets with nothing remembered: a table of other rows must not pass as the
    checked one, a page outside the pool must still be named."""
    query, pools, meta, kwargs = _base("v2")
    arrays = {"block_table": meta.block_table, "context_lens": meta.context_lens, "page_size": meta.page_size}
    changed = {**arrays, **{name: f(arrays[name]) for name, f in METADATA_VARIANTS[variant].items()}}

    def call(*_, **kw):  # _outcome's arguments; the metadata is the changed one
        return impl.paged_attention(query, *pools, changed["block_table"], changed["context_lens"],
                                    changed["page_size"], **kw)

    expected = _outcome(call, query, pools, _forgetting("contract", meta), kwargs)
    checked._contract_memo.clear()
    assert _outcome(_contract, query, pools, meta, kwargs)[0] == "computed"
    for _ in range(2):
        assert _outcome(call, query, pools, meta, kwargs) == expected


def test_a_repeated_contract_call_checks_only_the_metadata(monkeypatch):
    """Calls of one signature run check_arrays once; every call still checks the
    metadata's values (a page outside the pool in a table of the remembered shape)."""
    ran = _count_calls(monkeypatch, "check_arrays")
    query, pools, meta, kwargs = _base("v2")
    checked._contract_memo.clear()
    first = result_bits(_contract(query, *pools, meta, **kwargs))
    for _ in range(3):
        assert result_bits(_contract(query, *pools, meta, **kwargs)) == first
    assert len(ran) == 1 and len(checked._contract_memo) == 1
    bad = mx.full(meta.block_table.shape, meta.num_pages, dtype=mx.int32)
    with pytest.raises(impl.ContractViolation) as err:
        impl.paged_attention(query, *pools, bad, meta.context_lens, meta.page_size, **kwargs)
    assert err.value.clause == "page_id" and len(ran) == 1


def test_contract_signature_states_what_the_checks_read():
    query, pools, meta, kwargs = _base("v2")
    options = (None,) * len(checked.OPTIONS)
    table, lens = meta.block_table, meta.context_lens

    def key(t=table, n=lens, ps=meta.page_size):
        return checked.contract_signature(query, *pools, t, n, ps, options)

    assert key() == key() and key() is not None
    assert key(t=table.astype(mx.int64)) != key() != key(n=lens.astype(mx.int64))
    assert key(t=_two_rows(table)) != key() != key(n=_two_rows(lens))
    assert key(t=mx.concatenate([table, table], axis=1)) != key()
    assert key(t=table + 1) == key(n=lens + 1) == key()  # values are checked every call
    assert key(ps=meta.page_size + 1) != key()
    assert None is key(t=np.array(table)) is key(n=np.array(lens)) is key(ps=float(meta.page_size))
    assert None is key(ps=np.int64(meta.page_size)) is key(ps=True)


def test_contract_memo_drops_the_oldest():
    query, pools, meta, kwargs = _base("v2")
    checked._contract_memo.clear()
    scales = [0.1 + i / 64 for i in range(checked.CONTRACT_LIMIT + 8)]
    outs = {scale: result_bits(_contract(query, *pools, meta, **{**kwargs, "scale": scale})) for scale in scales}
    # each key's scale: a signature holds the options' values after its bytes of shapes and types
    remembered = {key[0][1 + checked.OPTIONS.index("scale")] for key in checked._contract_memo}
    assert remembered == set(scales[-checked.CONTRACT_LIMIT:])
    for scale, bits in outs.items():  # remembered or not, each call gives its own result
        assert result_bits(_contract(query, *pools, meta, **{**kwargs, "scale": scale})) == bits
