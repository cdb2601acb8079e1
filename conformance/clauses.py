"""The contract clauses (REFERENCE.md sections 1, 1b and 2) that operator checks point at.

A check names its clauses with `@pytest.mark.clause("gqa", ...)` (or per parameter); a
failing check's report carries the clause text, so a kernel author reads which rule of
the contract the output broke, not just that numbers differ.
"""

from __future__ import annotations

CLAUSES = {
    # section 1: what the output must be
    "oracle": "the output equals attention as section 1 defines it (float64 oracle, tolerance rule)",
    "addressing": "logical position j of request b lives at pages[block_table[b, j // page_size], g, j % page_size]",
    "gqa": "query head h reads KV head h // (Hq // Hkv): contiguous groups, not round-robin",
    "causal": "query row l sits at p = context_lens[b] - L + l and sees exactly the keys j <= p",
    "window": "with window w a causal query sees exactly the keys p - w < j <= p",
    "unmasked": "mask=None: every query row sees all context_lens[b] keys",
    "scale": "scores are (q . k) * scale, scale defaulting to D ** -0.5",
    "empty_row": "a row with context_lens[b] == 0 is an empty slot: zeros, and it never touches the pool",
    "dtype": "the output has the query's dtype and shape; accumulation in float32, one final cast",
    "stability": "softmax stays finite and accurate for huge or very negative logits",
    "shared_pages": "two rows may name the same physical page; the operator only reads",
    # section 1b: contract v2 (each checked only where the implementation declares the feature)
    "softcap": "soft-cap c > 0: s_j = c * tanh(s_j / c) on the scaled score, before bias and mask "
               "(never via exp, which overflows near |s/c| ~ 88)",
    "alibi": "ALiBi slopes [Hq]: s_j += slope_h * (j - p), after the cap",
    "sinks": "sinks [Hq]: m = max(max_j s_j, sigma_h), d = sum_j e^(s_j - m) + e^(sigma_h - m), "
             "o = sum_j e^(s_j - m) v_j / d; sigma never scaled or capped, counted once per row whatever the split",
    "lse": "return_lse: lse [B, Hq, L] float32 = m + ln d, natural log, sinks included; "
           "an empty row has lse -inf and a zero output",
    "merge_states": "merge_states: lse = logaddexp(a, b), o = e^(a - lse) o_a + e^(b - lse) o_b; "
                    "two empty states give (0, -inf)",
    "value_dim": "Dk != Dv: K pages [P, Hkv, ps, Dk], V pages [P, Hkv, ps, Dv], output [..., Dv], "
                 "default scale Dk ** -0.5",
    "kv_format": "quantized KV pages: x = decode(q) * s, e4m3fn (max 448, 0x7f/0xff NaN, no inf), e5m2 "
                 "(IEEE-like), int8; scales per tensor, per KV head or per (token, KV head) at the physical "
                 "slot, applied once to K and once to V",
    # section 2: invariants
    "inv1": "invariant 1: context_lens selects exactly the written positions",
    "inv2": "invariant 2: block_table reconstructs the dense logical order",
    "inv3": "invariant 3: shared pages are only read",
    "inv6": "invariant 6: a request's output bits do not depend on the other rows or the batch size",
    "inv7": "invariant 7: output bits do not depend on the number of worker threads",
    "inv8": "invariant 8: a prefill's row l equals the one-token decode at its position, bit for bit",
    "inv9": "invariant 9: unused slots, unread table entries and free pages are never read",
    "inv10": "invariant 10: bad input raises a specific error before anything is computed or written",
}

# Rejection clauses (impl/errors.py ids) -> the contract's words.
REJECTIONS = {
    "type": "arrays must be mlx.core.array",
    "rank": "wrong rank is rejected",
    "shape": "shapes that disagree are rejected",
    "dtype": "an unsupported query dtype or pools of another dtype are rejected",
    "metadata_dtype": "non-int32 block_table / context_lens are rejected",
    "heads": "Hq % Hkv != 0 is rejected",
    "page_size": "page_size < 1 or disagreeing with the pool is rejected",
    "scale": "a non-finite or non-numeric scale is rejected",
    "mask": "a mask other than 'causal' or None is rejected",
    "window": "a window < 1, or a window without causal masking, is rejected",
    "softcap": "a soft-cap <= 0, non-finite or not a number is rejected",
    "alibi_slopes": "ALiBi slopes that are not a float32 [Hq] array are rejected",
    "sinks": "sinks that are not a float32 [Hq] array are rejected",
    "lse": "a return_lse other than True or False is rejected",
    "value_shape": "value pages disagreeing with the key pages outside the head dim are rejected",
    "kv_dtype": "an unknown kv_dtype, or pages not holding its codes (uint8 for fp8, int8), are rejected",
    "kv_scale": "a k_scale / v_scale that is not a float > 0 or a float32 [], [Hkv] or [P, Hkv, ps] "
                "array, or a scale without a kv_dtype, is rejected",
    "merge": "merge_states inputs of mismatched shapes or dtypes are rejected",
    "context_negative": "a negative context length is rejected",
    "context_short": "0 < context_lens[b] < L is rejected",
    "table_short": "a row needing more than max_pages pages is rejected",
    "page_id": "a page id outside [0, P) among the pages a row reads is rejected",
}
CLAUSES.update({f"reject.{k}": f"invariant 10: {v}" for k, v in REJECTIONS.items()})


def describe(clause: str) -> str:
    try:
        return f"[{clause}] {CLAUSES[clause]}"
    except KeyError:
        raise KeyError(f"unknown contract clause {clause!r}; add it to conformance/clauses.py") from None
