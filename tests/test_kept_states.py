"""A decode's chunk states (impl/csrc/decode.cpp KeptStates): the (m, l) and partial
outputs of every request of several chunks, kept by the calling thread from one call to
the next, grown and never shrunk, up to 16 Mi floats (64 MiB); a call that needs more
allocates its own. Allocated per call, a B 16 S 32768 decode's 32 MiB of states faulted in
fresh pages every call (about 4 ms of a 90 ms bf16 call). A choice of speed only.

| what must hold                                                          | test                                   |
|-------------------------------------------------------------------------|----------------------------------------|
| states of up to 16 Mi floats are kept, more are not; bad input ValueError | test_keep_rule, test_keep_rule_bad_input |
| each calling thread has its own buffers, sized by its largest call so  | test_buffers_are_the_callers_and_grow  |
| far (slots x rows x 2 and x Dv), untouched by one-chunk requests       |                                        |
| what a kept buffer holds from an earlier call changes no bit, even     | test_stale_states_change_no_bit        |
| NaN, where a row sees no key of a chunk (its o is never read)          |                                        |
| a repeated call with 33 MiB of states faults in no fresh pages         | test_a_repeated_large_decode_faults_in_no_pages |
"""

from __future__ import annotations

import resource
import threading

import mlx.core as mx
import pagecheck_kernels
import pytest

import impl
from fixtures import bits, paged_case

pytestmark = [pytest.mark.correctness, pytest.mark.builtin_only("the built-in kernel's decode chunk states")]

KEPT_FLOATS = 16 << 20  # decode.cpp kKeptStateFloats
CHUNK = 256
SHAPE = dict(q_heads=8, kv_heads=2, head_dim=32, page_size=16)  # G 4


def test_keep_rule():
    assert [pagecheck_kernels.decode_keeps_states(n) for n in (0, 1, KEPT_FLOATS, KEPT_FLOATS + 1, 1 << 40)] == \
        [True, True, True, False, False]


def test_keep_rule_bad_input():
    with pytest.raises(ValueError, match="decode_keeps_states: floats must not be negative"):
        pagecheck_kernels.decode_keeps_states(-1)


def _now(case):
    """The case's bits through the entry that runs the kernel in the calling thread."""
    meta = impl.PagedMetadata.build(case.block_table, case.context_lens, page_size=case.page_size,
                                    num_pages=case.key_pages.shape[0], query_len=case.query.shape[2])
    return bits(impl.paged_attention_now(case.query, case.key_pages, case.value_pages, meta, **case.kwargs()))


def _in_a_new_thread(fn):
    """fn() on a thread of its own (fresh thread-local buffers); its result, or its error."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # re-raised in the test's thread
            out["error"] = e

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def _state_floats(*contexts, rows, head_dim, kv_heads=1):
    """[ml floats, o floats] of a call's states: requests of more than one chunk only,
    kv_heads slots a chunk, `rows` (G x L) a slot."""
    slots = sum(-(-c // CHUNK) for c in contexts if c > CHUNK) * kv_heads
    return [slots * rows * 2, slots * rows * head_dim]


def _expected(contexts, L=1):
    """_state_floats of SHAPE's calls."""
    return _state_floats(*contexts, rows=SHAPE["q_heads"] // SHAPE["kv_heads"] * L, head_dim=SHAPE["head_dim"],
                         kv_heads=SHAPE["kv_heads"])


def test_buffers_are_the_callers_and_grow():
    cases = {contexts: paged_case(context_lens=list(contexts), query_len=1, seed=83, **SHAPE)
             for contexts in ((600, 300, 100), (300,), (100, 200), (600, 600, 600))}
    _now(cases[(600, 600, 600)])  # this thread's buffers hold the largest call's states now

    def calls():
        seen = [pagecheck_kernels.decode_kept_state_floats()]
        for contexts, case in cases.items():
            _now(case)
            seen.append(pagecheck_kernels.decode_kept_state_floats())
        return seen

    first = _expected((600, 300, 100))
    assert _in_a_new_thread(calls) == [[0, 0], first, first, first, _expected((600, 600, 600))]
    assert first == [80, 1280]  # 5 chunks x 2 KV heads x 4 rows, x 2 and x D 32


def test_stale_states_change_no_bit():
    """Four rows, a window of 300. At context 558 row 0 sees key 255, the last of chunk 0,
    rows 1-3 none of it; at context 258 rows 0-1 see none of chunk 1 after seeing chunk 0
    (the merge folds a state in after another only where it saw a key). Those states are
    (m, l) only, o unwritten. A call of NaN queries first fills every slot of the buffers
    the case then reuses with NaN."""
    case = paged_case(context_lens=[558, 258], query_len=4, window=300, seed=89, **SHAPE)
    poison = paged_case(context_lens=[1024] * 4, query_len=4, seed=97, **SHAPE)
    poison = poison.with_(query=poison.query * float("nan"))
    mx.eval(poison.query)  # here: MLX evaluates lazy arrays on this thread's stream only
    assert _expected((1024,) * 4, L=4)[1] >= _expected((558, 258), L=4)[1]

    def calls():
        fresh = _now(case)
        assert pagecheck_kernels.decode_kept_state_floats() == _expected((558, 258), L=4)
        _now(poison)
        return fresh, _now(case)

    fresh, reused = _in_a_new_thread(calls)
    assert reused == fresh


def test_a_repeated_large_decode_faults_in_no_pages():
    """Why they are kept: states of more than glibc's 32 MiB threshold came from a fresh
    mmap every call and faulted in every page of it (B 16 S 32768 bf16: 8,470 faults and
    27 ms of system time a call, of a 90 ms call). Here 33.5 MiB of states over as many
    bytes of K/V: 64 query heads on one KV head, 8 query rows (512 rows a chunk), D 64,
    256 chunks of keys. The second and third calls fault in (next to) nothing; allocated
    per call, each faulted in 8,000+."""
    case = paged_case(context_lens=[65536], query_len=8, q_heads=64, kv_heads=1, head_dim=64, page_size=256,
                      seed=101, fill=0.0, extra_pages=0)
    floats = sum(_state_floats(65536, rows=512, head_dim=64))
    assert 32 << 20 < 4 * floats and pagecheck_kernels.decode_keeps_states(floats)
    first = _now(case)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    assert _now(case) == first and _now(case) == first
    assert resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before < 1000
