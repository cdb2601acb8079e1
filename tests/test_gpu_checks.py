"""gpu/checks.py: every rejection of the operator contract (REFERENCE.md 1, 1b) for torch
tensors, raised with its error type and a message naming the argument and the value,
before `gpu.paged.attention` allocates or computes anything; the inputs keep every bit.
The metadata's value rules are one vectorized pass with one host read."""

import time

import pytest

torch = pytest.importorskip("torch", reason="gpu/ needs torch")
pytest.importorskip("triton", reason="gpu/ needs triton")

from gpu import checks, paged  # noqa: E402

POSITIONAL = ("query", "key_pages", "value_pages", "block_table", "context_lens", "page_size")
INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _i32(rows):
    return torch.tensor(rows, dtype=torch.int32)


def _base():
    """Request 0: 10 positions in 3 pages of 4; request 1: 3 positions in 1 page (L = 3, P = 7)."""
    g = torch.Generator().manual_seed(41)
    return dict(query=torch.randn(2, 4, 3, 8, generator=g), key_pages=torch.randn(7, 2, 4, 8, generator=g),
                value_pages=torch.randn(7, 2, 4, 8, generator=g), block_table=_i32([[5, 0, 2], [3, -1, -1]]),
                context_lens=_i32([10, 3]), page_size=4)


def _table(c, b, i, value):
    t = c["block_table"].clone()
    t[b, i] = value
    return {"block_table": t}


def _split(call):
    return [call[n] for n in POSITIONAL], {k: v for k, v in call.items() if k not in POSITIONAL}


def _bits(call):
    return {k: v.view(INTS[v.element_size()]).clone() for k, v in call.items()
            if isinstance(v, torch.Tensor) and not v.is_meta}


def _meta(c, name):
    return {name: torch.empty(c[name].shape, dtype=c[name].dtype, device="meta")}


# name -> (the arguments it changes in _base, the error, its message)
BAD = {
    "query-list": (lambda c: {"query": c["query"].tolist()}, TypeError, r"query must be a torch.Tensor, got list"),
    "table-numpy": (lambda c: {"block_table": c["block_table"].numpy()}, TypeError,
                    r"block_table must be a torch.Tensor, got ndarray"),
    "query-rank": (lambda c: {"query": c["query"][0]}, ValueError,
                   r"query must be 4-D \[B, Hq, L, Dk\]; got shape \(4, 3, 8\)"),
    "pool-rank": (lambda c: {"value_pages": c["value_pages"][None]}, ValueError, r"value_pages must be 4-D"),
    "table-rank": (lambda c: {"block_table": c["block_table"][0]}, ValueError, r"block_table must be 2-D"),
    "lens-rank": (lambda c: {"context_lens": c["context_lens"][None]}, ValueError, r"context_lens must be 1-D"),
    "pool-device": (lambda c: _meta(c, "key_pages"), ValueError, r"key_pages is on meta but query is on cpu"),
    "table-device": (lambda c: _meta(c, "block_table"), ValueError, r"block_table is on meta but query is on cpu"),
    "query-int": (lambda c: {"query": c["query"].int()}, ValueError, r"query dtype int32 is not supported"),
    "query-f64": (lambda c: {"query": c["query"].double()}, ValueError, r"query dtype float64 is not supported"),
    "keys-dtype": (lambda c: {"key_pages": c["key_pages"].half()}, ValueError,
                   r"key_pages dtype float16 differs from query dtype float32"),
    "values-dtype": (lambda c: {"value_pages": c["value_pages"].bfloat16()}, ValueError,
                     r"value_pages dtype bfloat16 differs from query dtype float32"),
    "keys-fp8": (lambda c: {"key_pages": c["key_pages"].to(torch.float8_e4m3fn)}, ValueError,
                 r"key_pages dtype float8_e4m3fn differs .* no quantized pages"),
    "table-int64": (lambda c: {"block_table": c["block_table"].long()}, ValueError,
                    r"block_table must be int32, got int64"),
    "lens-float": (lambda c: {"context_lens": c["context_lens"].float()}, ValueError,
                   r"context_lens must be int32, got float32"),
    "values-shape": (lambda c: {"value_pages": c["value_pages"][:, :, :2]}, ValueError,
                     r"value_pages shape \(7, 2, 2, 8\) differs from key_pages shape \(7, 2, 4, 8\) "
                     r"outside the head dim"),
    "values-heads": (lambda c: {"value_pages": c["value_pages"][:, :1]}, ValueError,
                     r"value_pages shape \(7, 1, 4, 8\)"),
    "values-no-dim": (lambda c: {"value_pages": c["value_pages"][..., :0]}, ValueError,
                      r"value_pages shape \(7, 2, 4, 0\)"),
    "head-dim": (lambda c: {"query": c["query"][..., :4]}, ValueError, r"head dim differs: query D=4, key_pages D=8"),
    "table-rows": (lambda c: {"block_table": c["block_table"][:1]}, ValueError,
                   r"block_table has 1 rows but query has B=2 requests"),
    "lens-rows": (lambda c: {"context_lens": _i32([10, 3, 0])}, ValueError,
                  r"context_lens has 3 rows but query has B=2"),
    "gqa": (lambda c: {"query": c["query"][:, :3]}, ValueError, r"Hq=3 is not a multiple of Hkv=2"),
    "no-kv-heads": (lambda c: {"key_pages": c["key_pages"][:, :0], "value_pages": c["value_pages"][:, :0]}, ValueError,
                    r"Hq=4 is not a multiple of Hkv=0"),
    "page-size-pool": (lambda c: {"page_size": 8}, ValueError, r"page_size=8 disagrees with key_pages.shape\[2\]=4"),
    "page-size-zero": (lambda c: {"page_size": 0}, ValueError, r"page_size must be >= 1, got 0"),
    "page-size-float": (lambda c: {"page_size": 4.0}, TypeError, r"page_size must be an int, got float 4.0"),
    "page-size-bool": (lambda c: {"page_size": True}, TypeError, r"page_size must be an int, got bool True"),
    "scale-nan": (lambda c: {"scale": float("nan")}, ValueError, r"scale must be a finite float32 value, got nan"),
    "scale-inf": (lambda c: {"scale": -float("inf")}, ValueError, r"scale must be a finite float32 value, got -inf"),
    "scale-past-f32": (lambda c: {"scale": 1e39}, ValueError, r"scale must be a finite float32 value, got 1e\+39"),
    "scale-str": (lambda c: {"scale": "0.5"}, TypeError, r"scale must be a float, got str '0.5'"),
    "scale-bool": (lambda c: {"scale": True}, TypeError, r"scale must be a float, got bool True"),
    "scale-tensor": (lambda c: {"scale": torch.tensor(0.5)}, TypeError, r"scale must be a float, got Tensor"),
    "mask": (lambda c: {"mask": "full"}, ValueError, r"mask must be 'causal' or None, got 'full'"),
    "mask-int": (lambda c: {"mask": 1}, ValueError, r"mask must be 'causal' or None, got 1"),
    "window-zero": (lambda c: {"window": 0}, ValueError, r"window must be >= 1 or None, got 0"),
    "window-negative": (lambda c: {"window": -2}, ValueError, r"window must be >= 1 or None, got -2"),
    "window-float": (lambda c: {"window": 4.0}, TypeError, r"window must be an int, got float 4.0"),
    "window-unmasked": (lambda c: {"mask": None, "window": 4}, ValueError, r"window=4 needs mask='causal'"),
    "window-int32": (lambda c: {"window": 2 ** 31}, ValueError, r"window=2147483648 does not fit in int32"),
    "softcap-zero": (lambda c: {"softcap": 0.0}, ValueError, r"softcap must be a finite float32 value > 0, got 0.0"),
    "softcap-negative": (lambda c: {"softcap": -30}, ValueError,
                         r"softcap must be a finite float32 value > 0, got -30"),
    "softcap-inf": (lambda c: {"softcap": float("inf")}, ValueError,
                    r"softcap must be a finite float32 value > 0, got inf"),
    "softcap-str": (lambda c: {"softcap": "30"}, TypeError, r"softcap must be a float > 0 or None, got str '30'"),
    "alibi-list": (lambda c: {"alibi_slopes": [0.5] * 4}, TypeError, r"alibi_slopes must be a torch.Tensor .*got list"),
    "alibi-dtype": (lambda c: {"alibi_slopes": torch.ones(4, dtype=torch.float16)}, ValueError,
                    r"alibi_slopes must be float32, got float16"),
    "alibi-shape": (lambda c: {"alibi_slopes": torch.ones(2)}, ValueError,
                    r"alibi_slopes must have shape \[Hq\] = \(4,\), got \(2,\)"),
    "alibi-device": (lambda c: {"alibi_slopes": torch.ones(4, device="meta")}, ValueError,
                     r"alibi_slopes is on meta but query is on cpu"),
    "sinks-dtype": (lambda c: {"sinks": torch.zeros(4, dtype=torch.bfloat16)}, ValueError,
                    r"sinks must be float32, got bfloat16"),
    "sinks-shape": (lambda c: {"sinks": torch.zeros(4, 1)}, ValueError,
                    r"sinks must have shape \[Hq\] = \(4,\), got \(4, 1\)"),
    "sinks-device": (lambda c: {"sinks": torch.zeros(4, device="meta")}, ValueError, r"sinks is on meta"),
    "lse-str": (lambda c: {"return_lse": "yes"}, TypeError, r"return_lse must be True or False, got 'yes'"),
    "lse-int": (lambda c: {"return_lse": 1}, TypeError, r"return_lse must be True or False, got 1"),
    "context-negative": (lambda c: {"context_lens": _i32([10, -1])}, ValueError, r"context_lens\[1\] = -1 is negative"),
    "context-short": (lambda c: {"context_lens": _i32([10, 2])}, ValueError,
                      r"context_lens\[1\] = 2 is shorter than the query length L=3"),
    "table-short": (lambda c: {"context_lens": _i32([13, 3])}, ValueError,
                    r"request 0 needs 4 pages \(context 13, page_size 4\) but block_table rows hold max_pages=3"),
    "page-id-P": (lambda c: _table(c, 0, 2, 7), ValueError,
                  r"block_table\[0, 2\] = 7 is outside the pool \[0, 7\) \(request 0 reads logical page 2\)"),
    "page-id-negative": (lambda c: _table(c, 1, 0, -1), ValueError,
                         r"block_table\[1, 0\] = -1 is outside the pool \[0, 7\)"),
    "page-id-int32-min": (lambda c: _table(c, 0, 0, -2 ** 31), ValueError,
                          r"block_table\[0, 0\] = -2147483648 is outside"),
}


@pytest.fixture
def plans(monkeypatch):
    """The calls that got past the checks: `gpu.paged.plan` (outputs allocated, launches built) spied on."""
    calls = []

    def spy(query, key_pages, value_pages, *rest, **options):
        calls.append(options)
        return None, None, []

    monkeypatch.setattr(paged, "plan", spy)
    return calls


@pytest.mark.parametrize("name", sorted(BAD))
def test_rejected_call_raises_before_anything_is_computed(name, plans):
    change, error, message = BAD[name]
    base = _base()
    call = {**base, **change(base)}
    before = _bits(call)
    args, options = _split(call)
    with pytest.raises(error, match=message):
        checks.check_call(*args, **options)
    with pytest.raises(error, match=message):
        paged.attention(*args, **options)
    assert plans == [], "a rejected call allocated its outputs"
    after = _bits(call)
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before), \
        "a rejected call changed an input"


# name -> the arguments it changes in _base: each at a bound the contract allows
VALID = {
    "base": lambda c: {},
    "context-L": lambda c: {"context_lens": _i32([3, 3])},
    "context-0-row-unread": lambda c: {"context_lens": _i32([10, 0]), **_table(c, 1, 0, -99)},
    "pages-max_pages": lambda c: {"context_lens": _i32([12, 3])},
    "page-ids-0-and-P-1": lambda c: {"block_table": _i32([[0, 6, 6], [6, -1, -1]])},
    "unread-entries": lambda c: {"block_table": _i32([[5, 0, 2], [3, 12345, -2 ** 31]])},
    "no-table-columns": lambda c: {"block_table": c["block_table"][:, :0], "context_lens": _i32([0, 0])},
    "empty-batch": lambda c: {"query": c["query"][:0], "block_table": c["block_table"][:0],
                              "context_lens": c["context_lens"][:0]},
    "value-head-dim": lambda c: {"value_pages": c["value_pages"][..., :5]},
    "bfloat16": lambda c: {k: c[k].bfloat16() for k in ("query", "key_pages", "value_pages")},
    "options": lambda c: {"scale": 1, "window": 1, "softcap": 30, "alibi_slopes": torch.ones(4),
                          "sinks": torch.zeros(4), "return_lse": True},
    "option-bounds": lambda c: {"scale": -3.4e38, "window": 2 ** 31 - 1, "softcap": 3.4e38},
    "no-mask": lambda c: {"mask": None, "window": None},
}


@pytest.mark.parametrize("name", list(VALID))
def test_valid_call_passes_the_checks(name, plans):
    base = _base()
    call = {**base, **VALID[name](base)}
    args, options = _split(call)
    assert checks.check_call(*args, **options) is None
    paged.attention(*args, **options)
    assert len(plans) == 1, "a valid call did not reach the kernels"


def test_the_first_offending_request_is_named():
    """Requests in order, each request's rules in the table's order (a short context before its pages)."""
    g = torch.Generator().manual_seed(3)
    query, pages = torch.randn(4, 2, 2, 8, generator=g), torch.randn(5, 1, 4, 8, generator=g)
    table = _i32([[0, 1], [2, 9], [3, -1], [4, 4]])
    with pytest.raises(ValueError, match=r"block_table\[1, 1\] = 9 is outside the pool \[0, 5\)"):
        checks.check_call(query, pages, pages, table, _i32([8, 8, -1, 1]), 4)
    with pytest.raises(ValueError, match=r"context_lens\[1\] = 1 is shorter than the query length L=2"):
        checks.check_call(query, pages, pages, table, _i32([8, 1, -1, 1]), 4)


class _HostReads:
    """Counts the ways a tensor's values reach Python."""

    NAMES = ("tolist", "item", "numpy", "__bool__", "__int__", "__index__", "__float__")

    def __init__(self, monkeypatch):
        self.count = 0
        for name in self.NAMES:
            monkeypatch.setattr(torch.Tensor, name, self._counted(getattr(torch.Tensor, name)))

    def _counted(self, method):
        def counted(*args, **kwargs):
            self.count += 1
            return method(*args, **kwargs)

        return counted


def test_value_checks_read_the_host_once_and_do_not_loop(monkeypatch):
    """4096 requests of 64 pages, one page id outside the pool in the last request's last
    page: rejected naming it, from one host read, in well under a second."""
    B, max_pages, P = 4096, 64, 300
    query, pool = torch.zeros(B, 2, 1, 8), torch.zeros(P, 1, 4, 8)
    table = torch.randint(0, P, (B, max_pages), dtype=torch.int32, generator=torch.Generator().manual_seed(5))
    lens = torch.full((B,), max_pages * 4, dtype=torch.int32)
    checks.check_call(query, pool, pool, table, lens, 4)  # valid (and warm)
    table[B - 1, max_pages - 1] = P
    reads = _HostReads(monkeypatch)
    start = time.perf_counter()
    with pytest.raises(ValueError, match=rf"block_table\[4095, 63\] = {P} is outside the pool \[0, {P}\) "
                                         r"\(request 4095 reads logical page 63\)"):
        checks.check_call(query, pool, pool, table, lens, 4)
    seconds = time.perf_counter() - start
    assert reads.count == 1, f"{reads.count} host reads of tensor values (one expected)"
    assert seconds < 0.5, f"the value checks of 4096 requests took {seconds:.2f} s"
    reads.count = 0
    table[B - 1, max_pages - 1] = 0
    checks.check_call(query, pool, pool, table, lens, 4)
    assert reads.count == 1
