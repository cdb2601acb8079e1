"""A decode's value spans (impl/csrc/value_pass.h value_span): the keys of a chunk each KV head
weighs in one pass, its outputs in registers across them. A call whose K/V fit well in
the cache (at most 16 MiB) weighs 64 KiB of V rows at a time, a larger one 32 KiB (from
memory, longer spans were slower). A choice of speed only: every output
element adds its p_j v_j in ascending j either way.

| what must hold                                                          | test                                   |
|-------------------------------------------------------------------------|----------------------------------------|
| 64 KiB of V rows up to 16 MiB of K/V, 32 KiB beyond (at least a block, | test_span_rule                         |
| at most a chunk); bad inputs are ValueError                             | test_span_rule_bad_inputs              |
| a request's bits are the same alone (64 KiB spans) and in a batch over  | test_bits_do_not_depend_on_the_span    |
| 16 MiB (32 KiB spans), float32 and bfloat16, one and four rows          |                                        |
| the value pass asks for its next V rows except for 2-byte rows of a     | test_ask_rule                          |
| call within 16 MiB (bfloat16/float16 from cache); bad inputs ValueError | test_ask_rule_bad_inputs               |

The asks change no value either: the bits test's bfloat16 request alone runs without
them, in its batch with them.
"""

from __future__ import annotations

import pagecheck_kernels
import pytest

import impl
from fixtures import bits, paged_case

pytestmark = [pytest.mark.correctness, pytest.mark.builtin_only("the built-in kernel's decode value spans")]

MIB = 1 << 20
LIMIT = 16 * MIB  # value_pass.h kCachedKvBytes
CHUNK = 256


@pytest.mark.parametrize("row_bytes, cached, beyond", [(512, 128, 64), (256, CHUNK, 128), (128, CHUNK, CHUNK),
                                                        (4096, 16, 16), (1 << 20, 16, 16)])
def test_span_rule(row_bytes, cached, beyond):
    """V rows of 512 bytes (float32, D 128): 128 keys a span up to the limit, 64 beyond; 256
    (bf16) a chunk and 128; 128 (8-bit codes) a chunk both; very long rows one block."""
    spans = [pagecheck_kernels.decode_value_span(row_bytes, kv) for kv in (0, 1, LIMIT, LIMIT + 1, 1 << 40)]
    assert spans == [cached, cached, cached, beyond, beyond]


def test_span_rule_bad_inputs():
    for row_bytes, kv in ((0, 1), (-512, 1), (512, -1)):
        with pytest.raises(ValueError, match="value_row_bytes must be positive"):
            pagecheck_kernels.decode_value_span(row_bytes, kv)


@pytest.mark.parametrize("element_bytes, cached", [(4, True), (2, False), (1, True)])
def test_ask_rule(element_bytes, cached):
    """Within the limit only 2-byte rows go without asks (measured: float32 rows and the
    score loop's K asks lost without them); beyond it every type asks."""
    asks = [pagecheck_kernels.decode_value_asks(element_bytes, kv) for kv in (0, 1, LIMIT, LIMIT + 1, 1 << 40)]
    assert asks == [cached] * 3 + [True, True]


def test_ask_rule_bad_inputs():
    for element_bytes, kv in ((0, 1), (3, 1), (8, 1), (2, -1)):
        with pytest.raises(ValueError, match="element_bytes must be 1, 2 or 4"):
            pagecheck_kernels.decode_value_asks(element_bytes, kv)


# (dtype, requests): the batch holds more than LIMIT of K/V, each request alone less
# (2048 positions, 4 KV heads, D 128: 8 MiB float32, 4 MiB bfloat16).
BATCHES = [("float32", 3), ("bfloat16", 5)]


@pytest.mark.parametrize("L", [1, 4])
@pytest.mark.parametrize("dtype, requests", BATCHES, ids=[d for d, _ in BATCHES])
def test_bits_do_not_depend_on_the_span(dtype, requests, L):
    contexts = [2048] * requests
    case = paged_case(context_lens=contexts, query_len=L, q_heads=16, kv_heads=4, head_dim=128, page_size=16,
                      dtype=dtype, seed=61)
    itemsize = 4 if dtype == "float32" else 2
    per_request = 2048 * 4 * 2 * 128 * itemsize
    row_bytes = 128 * itemsize
    assert per_request * requests > LIMIT >= per_request
    assert pagecheck_kernels.decode_value_span(row_bytes, per_request) == 2 * pagecheck_kernels.decode_value_span(
        row_bytes, per_request * requests)
    out = case.run(impl.paged_attention)
    for b in range(requests):
        alone = case.with_(query=case.query[b:b + 1], block_table=case.block_table[b:b + 1],
                           context_lens=case.context_lens[b:b + 1])
        assert bits(alone.run(impl.paged_attention)) == bits(out[b:b + 1]), f"request {b}"
