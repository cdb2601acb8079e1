"""`ScorePipeline`: what one call computes from a query row's keys (the score pipeline).

Query row l of request b sits at `p = context_lens[b] - L + l`; `s_j` is its score of
key j. In order:

| step      | field          | meaning                                                     | type               |
|-----------|----------------|-------------------------------------------------------------|--------------------|
| scale     | `scale`        | `s_j = scale * q . k_j`                                     | float, default `Dk ** -0.5` |
| soft-cap  | `softcap`      | `s_j = c * tanh(s_j / c)` (the scaled score, before bias)   | float > 0 or None  |
| ALiBi     | `alibi_slopes` | `s_j += slope_h * (j - p)` (after the cap)                  | float32 `[Hq]` or None |
| mask      | `mask`, `window` | causal: `j <= p`; window w: `p - w < j <= p`; None: all keys | "causal"/None, int >= 1 |
| sinks     | `sinks`        | a logit `sigma_h` in the softmax's denominator, carrying no value, never scaled or capped, counted once per row | float32 `[Hq]` or None |
| LSE       | `return_lse`   | also return `lse = m + ln d` (natural log, sinks included; `-inf` for an empty slot) | bool |
| KV format | `kv_dtype`, `k_scale`, `v_scale` | pages of 8-bit codes, `k_j = decode(q) * s` (contract/kv_format.py) | str or None; float or float32 array |

With `m = max(max_j s_j, sigma_h)` and `d = sum_j e^(s_j - m) + e^(sigma_h - m)` (the
sink term only with sinks), the output row is `sum_j e^(s_j - m) v_j / d`.

`kwargs()` gives the keyword arguments of the call: the first three always, the
contract-v2 ones only when used, so a kernel written against the first contract is
still called with the signature it knows.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from .kv_format import KVFormat

# The keyword arguments of a call, in the order of the table above.
OPTIONS = ("scale", "mask", "window", "softcap", "alibi_slopes", "sinks", "return_lse", "kv_dtype", "k_scale",
           "v_scale")
# Contract-v2 features -> the option that switches each on (capability names).
FEATURES = {"softcap": "softcap", "alibi": "alibi_slopes", "sinks": "sinks", "lse": "return_lse"}
_V1 = ("scale", "mask", "window")


@dataclass(frozen=True, eq=False)
class ScorePipeline:
    scale: float | None = None
    mask: str | None = "causal"
    window: int | None = None
    softcap: float | None = None
    alibi_slopes: object = None
    sinks: object = None
    return_lse: bool = False
    kv_dtype: str | None = None
    k_scale: object = None
    v_scale: object = None

    @classmethod
    def of(cls, kwargs: dict | None = None, **more) -> ScorePipeline:
        """From a call's keyword arguments; an unknown one is a TypeError, as in a call."""
        given = {**(kwargs or {}), **more}
        unknown = sorted(set(given) - set(OPTIONS))
        if unknown:
            raise TypeError(f"unexpected keyword argument {unknown[0]!r} (the call's options: {', '.join(OPTIONS)})")
        return cls(**given)

    def kwargs(self) -> dict:
        out = {name: getattr(self, name) for name in _V1}
        for name in OPTIONS[len(_V1):]:
            value = getattr(self, name)
            if value is not None and value is not False:
                out[name] = value
        return out

    def features(self) -> tuple[str, ...]:
        """The contract-v2 features this call uses (keys of FEATURES), in table order."""
        return tuple(f for f, option in FEATURES.items()
                     if getattr(self, option) is not None and getattr(self, option) is not False)

    @property
    def kv(self) -> KVFormat:
        """How the pages are stored (contract/kv_format.py)."""
        return KVFormat(self.kv_dtype, self.k_scale, self.v_scale)

    def with_(self, **changes) -> ScorePipeline:
        return replace(self, **changes)

    @property
    def causal(self) -> bool:
        return self.mask is not None

    def describe(self) -> str:
        """One line for reports and skip reasons, e.g. `causal, window 4, softcap 30, sinks, lse`."""
        parts = ["causal" if self.causal else "unmasked"]
        if self.window is not None:
            parts.append(f"window {self.window}")
        if self.scale is not None:
            parts.append(f"scale {self.scale:g}" if isinstance(self.scale, (int, float)) else "scale")
        if self.softcap is not None:
            parts.append(f"softcap {self.softcap:g}" if isinstance(self.softcap, (int, float)) else "softcap")
        parts += [name for name in ("alibi", "sinks", "lse") if name in self.features()]
        if self.kv.quantized:
            parts.append(self.kv.describe())
        return ", ".join(parts)


assert tuple(f.name for f in fields(ScorePipeline)) == OPTIONS
