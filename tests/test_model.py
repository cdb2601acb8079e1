"""Model-level check: mlx-lm models with the paged cache and the paged operator plugged
in decode exactly the tokens mlx-lm's own caches do.

Requests of different prompt lengths are prefilled one by one into one shared pool,
then decoded together as one batch (per-request RoPE offsets, no padding); the
reference decodes each request alone with mlx-lm's prompt cache. Two architectures:
Qwen3 (dense `KVCache`), and gpt-oss (attention sinks; sliding-window layers, which
mlx-lm keeps in a `RotatingKVCache`, alternating with full ones; the paged cache keeps
every position and the operator applies each layer's window). Plus a bfloat16 run of
the Qwen3 check. Skipped without the optional extra `model` (mlx-lm).
"""

from __future__ import annotations

import importlib

import mlx.core as mx
import numpy as np
import pytest

from fixtures.models import TINY_GPT_OSS, greedy_dense, prompts, tiny_gpt_oss, tiny_qwen3
from impl.batch import StepBatch
from impl.cache import PagedCache
from impl.errors import ServingError
from impl.mlx_lm_adapter import PagedBatch, layer_windows, patch_attention
from impl.pool import PagePool

pytest.importorskip("mlx_lm.models.qwen3", reason="needs the optional extra `model` (mlx-lm)")

pytestmark = [pytest.mark.correctness, pytest.mark.builtin_only("pagecheck's serving core inside mlx-lm")]

LENGTHS = (5, 17, 33, 64)
NEW_TOKENS = 12
# gpt-oss: one prompt inside the window (8), the others past it (the decode slides too).
OSS_LENGTHS = (5, 13, 30, 47)


def greedy_paged(model, batch_prompts, new_tokens, *, page_size=4, window=None, windows=None,
                 dtype=mx.float32, forced=None, **pool_options):
    """Greedy decode through the paged cache; `forced[b]`: feed these tokens instead of
    the argmax (teacher forcing, to compare logits along the reference's path);
    `pool_options` go to the PagePool (a quantized pool: kv_dtype, scales)."""
    module = importlib.import_module(type(model).__module__)
    args = model.args
    pool = PagePool(num_layers=len(model.layers), kv_heads=args.num_key_value_heads, head_dim=args.head_dim,
                    page_size=page_size, dtype=dtype,
                    num_pages=sum(-(-(len(p) + new_tokens) // page_size) for p in batch_prompts) + 2,
                    **pool_options)
    caches = [PagedCache(pool) for _ in batch_prompts]
    history = [[] for _ in batch_prompts]
    with patch_attention(module):
        last = []
        for cache, prompt in zip(caches, batch_prompts):
            single = PagedBatch([cache], window=window, windows=windows)
            single.begin_step(len(prompt))
            last.append(model(mx.array(prompt)[None], cache=single.layer_views())[0, -1])
        batch = PagedBatch(caches, window=window, windows=windows)
        logits = mx.stack(last)
        for step in range(new_tokens):
            for b, row in enumerate(np.array(logits.astype(mx.float32))):
                history[b].append(row)
            if step + 1 == new_tokens:
                break
            tokens = mx.argmax(logits, axis=-1) if forced is None else mx.array([f[step] for f in forced])
            batch.begin_step(1)
            logits = model(tokens[:, None], cache=batch.layer_views())[:, -1]
    tokens = [[int(np.argmax(row)) for row in h] for h in history]
    return tokens, history, caches


def logits_of(runs):
    """The per-step logits of `greedy_dense` runs ([(tokens, logits)] per request)."""
    return [history for _, history in runs]


def worst_gap(a, b) -> float:
    """Largest logit difference of two runs (per request, per step, over the vocabulary)."""
    return max(float(np.max(np.abs(x - y))) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def top2_margin(row) -> float:
    return float(np.diff(np.sort(row)[-2:])[0])


def top2_margins(reference) -> np.ndarray:
    return np.array([top2_margin(row) for history in logits_of(reference) for row in history])


# --- Qwen3, float32 -----------------------------------------------------------------

@pytest.fixture(scope="module")
def model():
    return tiny_qwen3()


@pytest.fixture(scope="module")
def reference(model):
    return [greedy_dense(model, p, NEW_TOKENS) for p in prompts(LENGTHS)]


def test_paged_batch_decodes_the_dense_tokens(model, reference):
    tokens, history, caches = greedy_paged(model, prompts(LENGTHS), NEW_TOKENS)
    assert tokens == [ref_tokens for ref_tokens, _ in reference]
    # Same logits up to float32 rounding, and the greedy choices were never near a tie,
    # so the token match above is a real agreement, not luck.
    worst, margin = worst_gap(logits_of(reference), history), top2_margins(reference).min()
    assert worst < 1e-3 and margin > 10 * worst, (worst, margin)
    assert [c.length for c in caches] == [n + NEW_TOKENS - 1 for n in LENGTHS]


def test_page_size_does_not_change_the_tokens(model, reference):
    for page_size in (1, 16):
        tokens, _, _ = greedy_paged(model, prompts(LENGTHS), NEW_TOKENS, page_size=page_size)
        assert tokens == [ref_tokens for ref_tokens, _ in reference], page_size


def test_the_check_bites_a_broken_attention(model, reference):
    # A window of 2 keys drops most of the context: the tokens must stop matching.
    tokens, _, _ = greedy_paged(model, prompts(LENGTHS), NEW_TOKENS, window=2)
    assert tokens != [ref_tokens for ref_tokens, _ in reference]


def test_quantized_pools_run_the_model(model, reference):
    """The tiny Qwen3 over fp8 and int8 pools with per-token scales (the write path
    quantizes, the kernel decodes), teacher-forced along the float32 tokens: its logits
    move away from float32's by the formats' precision, in their order (int8's 7 bits
    per row max, e4m3's 3 mantissa bits, e5m2's 2). Measured gaps: int8 0.16, e4m3 0.84,
    e5m2 2.04 at logits up to 10.4 (the tiny model's top-2 margins go down to 0.02, so
    greedy tokens are not compared)."""
    forced = [ref_tokens for ref_tokens, _ in reference]
    top = max(float(np.abs(row).max()) for history in logits_of(reference) for row in history)
    gaps = {}
    for kv_dtype in ("int8", "float8_e4m3fn", "float8_e5m2"):
        _, history, caches = greedy_paged(model, prompts(LENGTHS), NEW_TOKENS, forced=forced, kv_dtype=kv_dtype,
                                          scales="token")
        assert caches[0].pool.kv_dtype == kv_dtype
        gaps[kv_dtype] = worst_gap(logits_of(reference), history)
    assert 0 < gaps["int8"] < gaps["float8_e4m3fn"] < gaps["float8_e5m2"] < 0.25 * top, gaps


# --- Qwen3, bfloat16 ------------------------------------------------------------------

# bf16 unit roundoff (8 significand bits).
BF16_U = 2.0 ** -8
# The paged bf16 run's worst logit error against the float32 model may exceed mlx-lm's own
# bf16 run's by this factor (measured 0.92: the paged run is the closer of the two).
BF16_ENVELOPE = 1.25
# Paged vs mlx-lm bf16 logits: within this many u * max|logit| (measured 4.8; each run is
# about 7 from float32).
BF16_ROUNDOFF = 8


def test_bfloat16_paged_decode_is_as_accurate_as_mlx_lms(model):
    """The Qwen3 check in bfloat16 (weights, activations, pool, operator): what it can assert.

    The two bf16 runs round in different places (pagecheck's kernel runs the bf16 tiles
    on AMX, softmax weights rounded to bf16 before P.V; MLX's dense CPU SDPA rounds the
    scores to bf16, then the softmax weights, around two bf16 matmuls), so their logits
    differ by bf16 rounding, about 3 bf16 ulps of the largest logit, while the greedy
    top-2 margins go down to 1 ulp: equal tokens at every step are not a property of a
    correct kernel. Asserted, teacher-forced along mlx-lm's bf16 tokens:
    1. accuracy: the paged run's worst logit error against the float32 model is at most
       BF16_ENVELOPE x mlx-lm's own bf16 run's (both measured here);
    2. agreement: paged vs mlx-lm bf16 logits within BF16_ROUNDOFF * u * max|logit|;
    3. tokens: the free-running paged decode picks mlx-lm's token at every step whose
       top-2 margin exceeds 2 x the measured worst logit gap G (with |dlogit| <= G the
       argmax cannot move), up to where the two paths part at a step within the noise;
       such steps must be at least half of all (the claim is not vacuous);
    4. the bounds bite: a 2-key window breaks 1 by more than 10x.
    """
    model16 = tiny_qwen3(dtype=mx.bfloat16)
    batch_prompts = prompts(LENGTHS)
    dense16 = [greedy_dense(model16, p, NEW_TOKENS) for p in batch_prompts]
    path = [tokens for tokens, _ in dense16]
    exact = [greedy_dense(model, p, NEW_TOKENS, forced=f)[1] for p, f in zip(batch_prompts, path)]
    _, paged16, _ = greedy_paged(model16, batch_prompts, NEW_TOKENS, dtype=mx.bfloat16, forced=path)

    theirs, mine = worst_gap(logits_of(dense16), exact), worst_gap(paged16, exact)
    between = worst_gap(paged16, logits_of(dense16))
    largest = max(float(np.max(np.abs(row))) for history in logits_of(dense16) for row in history)
    numbers = dict(paged_vs_f32=mine, mlx_lm_vs_f32=theirs, paged_vs_mlx_lm=between, max_logit=largest)
    assert mine <= BF16_ENVELOPE * theirs, numbers
    assert between <= BF16_ROUNDOFF * BF16_U * largest, numbers

    tokens16, _, _ = greedy_paged(model16, batch_prompts, NEW_TOKENS, dtype=mx.bfloat16)
    guaranteed = 0
    for mine_tokens, (ref_tokens, ref_logits) in zip(tokens16, dense16):
        for step, (t_mine, t_ref, row) in enumerate(zip(mine_tokens, ref_tokens, ref_logits)):
            if top2_margin(row) > 2 * between:
                assert t_mine == t_ref, (step, top2_margin(row), numbers)
                guaranteed += 1
            elif t_mine != t_ref:
                break  # a near-tie: the paths may part here, and nothing after is comparable
    assert guaranteed >= len(LENGTHS) * NEW_TOKENS // 2, (guaranteed, numbers)

    _, narrowed, _ = greedy_paged(model16, batch_prompts, NEW_TOKENS, dtype=mx.bfloat16, forced=path, window=2)
    assert worst_gap(narrowed, exact) > 10 * BF16_ENVELOPE * theirs, numbers


# --- gpt-oss: sinks and per-layer sliding windows -------------------------------------

@pytest.fixture(scope="module")
def oss_model():
    return tiny_gpt_oss()


@pytest.fixture(scope="module")
def oss_reference(oss_model):
    return [greedy_dense(oss_model, p, NEW_TOKENS) for p in prompts(OSS_LENGTHS)]


def test_gpt_oss_layer_windows_come_from_mlx_lms_caches(oss_model):
    w = TINY_GPT_OSS["sliding_window"]
    assert layer_windows(oss_model) == [w, None, w, None]
    assert layer_windows(tiny_qwen3()) == [None, None]


def test_gpt_oss_paged_batch_decodes_mlx_lms_tokens(oss_model, oss_reference):
    windows = layer_windows(oss_model)
    tokens, history, caches = greedy_paged(oss_model, prompts(OSS_LENGTHS), NEW_TOKENS, windows=windows)
    assert tokens == [ref_tokens for ref_tokens, _ in oss_reference]
    worst, margin = worst_gap(logits_of(oss_reference), history), top2_margins(oss_reference).min()
    assert worst < 1e-3 and margin > 10 * worst, (worst, margin)
    # The paged cache keeps every position (mlx-lm's rotating cache keeps the last 8).
    assert [c.length for c in caches] == [n + NEW_TOKENS - 1 for n in OSS_LENGTHS]
    tokens, _, _ = greedy_paged(oss_model, prompts(OSS_LENGTHS), NEW_TOKENS, windows=windows, page_size=16)
    assert tokens == [ref_tokens for ref_tokens, _ in oss_reference]


def _drop(option):
    """StepBatch.attend that loses one option on the way to the operator (a broken adapter)."""
    attend = StepBatch.attend

    def broken(self, layer, queries, **kwargs):
        kwargs.pop(option)
        return attend(self, layer, queries, **kwargs)
    return broken


@pytest.mark.parametrize("option", ["sinks", "window"])
def test_gpt_oss_check_bites_a_dropped_sink_or_window(oss_model, oss_reference, monkeypatch, option):
    monkeypatch.setattr(StepBatch, "attend", _drop(option))
    tokens, _, _ = greedy_paged(oss_model, prompts(OSS_LENGTHS), NEW_TOKENS, windows=layer_windows(oss_model))
    assert tokens != [ref_tokens for ref_tokens, _ in oss_reference]


def test_gpt_oss_batch_without_its_windows_is_refused(oss_model):
    pool = PagePool(num_layers=len(oss_model.layers), kv_heads=TINY_GPT_OSS["num_key_value_heads"],
                    head_dim=TINY_GPT_OSS["head_dim"], page_size=4, num_pages=8)
    batch = PagedBatch([PagedCache(pool)])
    batch.begin_step(9)
    with patch_attention(importlib.import_module(type(oss_model).__module__)):
        with pytest.raises(ServingError, match="window 8"):
            oss_model(mx.array(prompts([9])), cache=batch.layer_views())


def test_gpt_oss_sinks_held_in_bfloat16_are_widened():
    # A checkpoint loaded in bf16 holds its sinks in bf16; the operator takes float32, and
    # the adapter widens them (exact). The model stays float32 otherwise: mlx-lm's MoE
    # (gather_mm) has no bf16 on the CPU, so a whole bf16 gpt-oss cannot run here.
    model = tiny_gpt_oss()
    for layer in model.layers:
        layer.self_attn.sinks = layer.self_attn.sinks.astype(mx.bfloat16)
    reference = [greedy_dense(model, p, NEW_TOKENS) for p in prompts(OSS_LENGTHS)]
    tokens, _, _ = greedy_paged(model, prompts(OSS_LENGTHS), NEW_TOKENS, windows=layer_windows(model))
    assert tokens == [ref_tokens for ref_tokens, _ in reference]
