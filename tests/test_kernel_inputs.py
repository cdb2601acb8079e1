"""How the compiled operator takes its arrays into MLX's graph (impl/csrc/paged_attention.cpp,
`row_contiguous`).

| input                                   | enters the graph            |
|-----------------------------------------|-----------------------------|
| evaluated and row-contiguous            | as it is (no node)          |
| evaluated view (strided, transposed, offset) | through `mx.contiguous` |
| not yet evaluated                       | through `mx.contiguous`     |

Each `mx.contiguous` is a node that the CPU stream schedules and runs: nine of them a call
were most of a small decode's fixed cost. Whatever way an array enters, the kernel must
read its values: the same bits as the plain contiguous call."""

from __future__ import annotations

import io

import mlx.core as mx
import numpy as np
import pytest

import impl
from fixtures import bits, paged_case

pytestmark = [pytest.mark.correctness,
              pytest.mark.builtin_only("the built-in operator's graph (MLX nodes), not the contract")]

ARGS = ("query", "key_pages", "value_pages", "block_table", "context_lens")


def _flipped(x: np.ndarray) -> mx.array:
    """x's values through a view whose last two axes (the only one, for 1-D) are reversed
    or swapped in memory: not row-contiguous."""
    if x.ndim == 1:
        return mx.array(np.ascontiguousarray(x[::-1]))[::-1]
    return mx.swapaxes(mx.array(np.ascontiguousarray(np.swapaxes(x, -1, -2))), -1, -2)


# Each gives an MLX array holding exactly x's values in another layout.
VIEWS = {
    "transposed": _flipped,
    "strided": lambda x: mx.array(np.repeat(x, 2, axis=0))[::2],
    "offset": lambda x: mx.array(np.concatenate([x[:1], x]))[1:],
}


def _numpy(a: mx.array) -> np.ndarray:
    return np.array(a.view(mx.uint16)) if a.dtype == mx.bfloat16 else np.array(a)


def _as(a: mx.array, values: np.ndarray) -> mx.array:
    return values.view(mx.bfloat16) if a.dtype == mx.bfloat16 else values


def _case(dtype="float32"):
    return paged_case(context_lens=[37, 5, 20], query_len=2, q_heads=4, kv_heads=2, head_dim=32, page_size=8,
                      dtype=dtype, seed=3)


@pytest.mark.parametrize("evaluated", [True, False], ids=["evaluated", "lazy"])
@pytest.mark.parametrize("view", VIEWS)
@pytest.mark.parametrize("arg", ARGS)
def test_every_layout_is_read_as_its_values(arg, view, evaluated):
    """An evaluated view is not row-contiguous and must not go in as one; a lazy one
    has no layout yet. Both give the bits of the contiguous call."""
    for dtype in ("float32", "bfloat16"):
        case = _case(dtype)
        want = bits(case.run(impl.paged_attention))
        original = getattr(case, arg)
        x = _as(original, VIEWS[view](_numpy(original)))
        if evaluated:
            mx.eval(x)
        assert bits(case.with_(**{arg: x}).run(impl.paged_attention)) == want, (arg, view, dtype)


def _graph(out: mx.array) -> str:
    dot = io.StringIO()
    mx.export_to_dot(dot, out)
    return dot.getvalue()


def test_evaluated_contiguous_arrays_add_no_node():
    """The whole graph of a call on evaluated contiguous arrays is the operator's node:
    no mx.contiguous, no constant made for an absent option."""
    case = _case()
    mx.eval(case.query, case.key_pages, case.value_pages, case.block_table, case.context_lens)
    graph = _graph(impl.paged_attention(case.query, case.key_pages, case.value_pages, case.block_table,
                                        case.context_lens, case.page_size))
    assert graph.count("shape=rectangle") == 1 and "PagedAttention" in graph, graph


@pytest.mark.parametrize("arg", ARGS)
def test_a_lazy_or_strided_array_goes_through_contiguous(arg):
    """One mx.contiguous for the one array that needs it, whichever argument it is. The
    metadata's value check evaluates a lazy table or lengths (in place), so those then
    go in as they are."""
    case = _case()
    mx.eval(case.query, case.key_pages, case.value_pages, case.block_table, case.context_lens)
    strided = VIEWS["strided"](_numpy(getattr(case, arg)))
    mx.eval(strided)
    lazy_nodes = 0 if arg in ("block_table", "context_lens") else 1
    for x, nodes in ((getattr(case, arg) * 1, lazy_nodes), (strided, 1)):
        call = case.with_(**{arg: x})
        graph = _graph(impl.paged_attention(call.query, call.key_pages, call.value_pages, call.block_table,
                                            call.context_lens, call.page_size))
        assert graph.count('"Contiguous"') == nodes, graph
