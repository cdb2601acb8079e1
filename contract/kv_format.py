"""`KVFormat`: how the K/V pages of a call are stored (REFERENCE.md section 1b, quantized KV).

Without a format the pages hold the query's dtype (float32, float16, bfloat16). With one,
each page element is a code `q` of an 8-bit format and the value it stands for is
`x = decode(q) * s`, `s` its scale:

| `kv_dtype`       | pages hold              | decode(q)                                                         | largest finite |
|------------------|-------------------------|-------------------------------------------------------------------|----------------|
| `float8_e4m3fn`  | uint8 bit patterns      | sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 subnormal; `0x7f`/`0xff` NaN; no inf | 448 |
| `float8_e5m2`    | uint8 bit patterns      | sign, 5 exponent bits (bias 15), 2 mantissa bits: the top byte of a float16 (inf and NaN as IEEE) | 57344 |
| `int8`           | int8                    | the integer itself (symmetric: the write path uses -127 .. 127)    | 127            |

MLX has no fp8 dtype, so fp8 pages are `uint8` arrays of bit patterns with the format
named here. Scales (`k_scale` for the key pages, `v_scale` for the value pages) are
float32, each in one of three granularities, told apart by their shape:

| granularity | shape            | element `[p, g, slot, d]` is scaled by | who uses it |
|-------------|------------------|----------------------------------------|-------------|
| `tensor`    | `[]` or a float  | `s`                                    | vLLM `k_scale`/`v_scale`, FlashInfer, FA3 (one per layer) |
| `head`      | `[Hkv]`          | `s[g]`                                 | per-head calibration |
| `token`     | `[P, Hkv, ps]`   | `s[p, g, slot]`: beside the pages, indexed by the *physical* slot | vLLM Triton / SGLang int8 |

A missing scale is 1.0 (a tensor scale). Query and output stay float32 / float16 /
bfloat16. The kernel's job is exact attention over the dequantized K/V: the oracles
dequantize with the formula above and the tolerance rule applies to that; the error the
quantization itself adds against the unquantized K/V is reported apart, per format.

This module holds names and facts, no arithmetic: the write path (impl/) quantizes and
the oracles decode, each on its own.
"""

from __future__ import annotations

from dataclasses import dataclass

# format -> (storage dtype name of its pages, largest finite value)
KV_DTYPES = {
    "float8_e4m3fn": ("uint8", 448.0),
    "float8_e5m2": ("uint8", 57344.0),
    "int8": ("int8", 127.0),
}
GRANULARITIES = ("tensor", "head", "token")


def storage_dtype(kv_dtype: str) -> str:
    """The dtype name (mlx / numpy) of the pages of `kv_dtype`."""
    return KV_DTYPES[kv_dtype][0]


def max_finite(kv_dtype: str) -> float:
    return KV_DTYPES[kv_dtype][1]


def granularity_of(shape: tuple, *, num_pages: int, kv_heads: int, page_size: int) -> str | None:
    """`tensor`, `head` or `token` for a scale of this shape in a pool `[P, Hkv, ps, D]`,
    or None when the shape is none of the three."""
    shape = tuple(shape)
    if shape == ():
        return "tensor"
    if shape == (kv_heads,):
        return "head"
    if shape == (num_pages, kv_heads, page_size):
        return "token"
    return None


@dataclass(frozen=True, eq=False)
class KVFormat:
    """The KV part of a call's description: `dtype` None means pages in the query's dtype."""

    dtype: str | None = None
    k_scale: object = None  # float, or float32 array of a shape in the table above; None: 1.0
    v_scale: object = None

    @property
    def quantized(self) -> bool:
        return self.dtype is not None

    def granularities(self, *, num_pages: int, kv_heads: int, page_size: int) -> tuple[str | None, str | None]:
        """(K's, V's) granularity; a missing or Python-number scale is `tensor`."""
        return tuple(
            "tensor" if s is None or isinstance(s, (int, float)) else
            granularity_of(getattr(s, "shape", ()), num_pages=num_pages, kv_heads=kv_heads, page_size=page_size)
            for s in (self.k_scale, self.v_scale))

    def describe(self) -> str:
        if not self.quantized:
            return "unquantized"
        scales = [name for name, s in (("k_scale", self.k_scale), ("v_scale", self.v_scale)) if s is not None]
        return self.dtype + (f" ({', '.join(scales)})" if scales else "")
