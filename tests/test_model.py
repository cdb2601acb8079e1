"""Model-level check: mlx-lm's Qwen3 with the paged cache and the paged operator plugged
in decodes exactly the tokens mlx-lm's own dense cache does.

Requests of different prompt lengths are prefilled one by one into one shared pool,
then decoded together as one batch (per-request RoPE offsets, no padding); the
reference decodes each request alone with mlx-lm's `KVCache`. Skipped without the
optional extra `model` (mlx-lm).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from fixtures.models import TINY_QWEN3, greedy_dense, prompts, tiny_qwen3
from impl.cache import PagedCache
from impl.mlx_lm_adapter import PagedBatch, patch_attention
from impl.pool import PagePool

qwen3 = pytest.importorskip("mlx_lm.models.qwen3", reason="needs the optional extra `model` (mlx-lm)")

pytestmark = [pytest.mark.correctness, pytest.mark.builtin_only("pagecheck's serving core inside mlx-lm")]

LENGTHS = (5, 17, 33, 64)
NEW_TOKENS = 12


def greedy_paged(model, batch_prompts, new_tokens, *, page_size=4, window=None):
    pool = PagePool(num_layers=TINY_QWEN3["num_hidden_layers"], kv_heads=TINY_QWEN3["num_key_value_heads"],
                    head_dim=TINY_QWEN3["head_dim"], page_size=page_size,
                    num_pages=sum(-(-(len(p) + new_tokens) // page_size) for p in batch_prompts) + 2)
    caches = [PagedCache(pool) for _ in batch_prompts]
    history = [[] for _ in batch_prompts]
    with patch_attention(qwen3):
        last = []
        for cache, prompt in zip(caches, batch_prompts):
            single = PagedBatch([cache], window=window)
            single.begin_step(len(prompt))
            last.append(model(mx.array(prompt)[None], cache=single.layer_views())[0, -1])
        batch = PagedBatch(caches, window=window)
        logits = mx.stack(last)
        for step in range(new_tokens):
            for b, row in enumerate(np.array(logits)):
                history[b].append(row)
            if step + 1 == new_tokens:
                break
            tokens = mx.argmax(logits, axis=-1)
            batch.begin_step(1)
            logits = model(tokens[:, None], cache=batch.layer_views())[:, -1]
    tokens = [[int(np.argmax(row)) for row in h] for h in history]
    return tokens, history, caches


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
    worst = max(np.max(np.abs(a - b)) for (_, ref), mine in zip(reference, history) for a, b in zip(ref, mine))
    margin = min(np.diff(np.sort(row)[-2:])[0] for _, ref in reference for row in ref)
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
