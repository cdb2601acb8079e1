"""The run's shapes (Qwen3-4B's heads) and the goal it judges them by."""

from __future__ import annotations

from dataclasses import dataclass

GOAL_FRACTION = 0.8
GOAL_MIN_S = 8192
GOAL_TEXT = f"decode (L=1) at S >= {GOAL_MIN_S}: at least {GOAL_FRACTION:.0%} of the measured HBM copy bandwidth"


@dataclass(frozen=True)
class Row:
    kind: str  # "decode" (L=1) or "prefill" (L=S)
    B: int
    S: int
    page_size: int
    dtype: str
    Hq: int = 32
    Hkv: int = 8
    D: int = 128

    @property
    def L(self) -> int:
        return 1 if self.kind == "decode" else self.S

    @property
    def name(self) -> str:
        return f"{self.kind} B{self.B} S{self.S} ps{self.page_size} {self.dtype}"

    def bytes(self) -> int:
        item = 4 if self.dtype == "float32" else 2
        kv = self.B * self.S * self.Hkv * self.D * 2 * item
        return kv + 2 * self.B * self.Hq * self.L * self.D * item

    def flops(self) -> float:
        """QK^T and PV over the causally visible pairs."""
        pairs = self.S if self.L == 1 else self.L * (self.L + 1) // 2 + self.L * (self.S - self.L)
        return 4.0 * self.B * self.Hq * self.D * pairs

    def work(self) -> float:
        return float(self.bytes()) if self.kind == "decode" else self.flops()


def gpu_rows() -> list[Row]:
    """In order of importance (a short budget drops the tail): bf16 decode, bf16 prefill, then f16."""
    rows = []
    for dtype in ("bfloat16", "float16"):
        for S in (8192, 32768, 1024):
            for B in (16, 1):
                for ps in (16, 128):
                    rows.append(Row("decode", B, S, ps, dtype))
        for S in (1024, 8192):
            for ps in (128, 16):
                rows.append(Row("prefill", 1, S, ps, dtype))
    return rows


def dry_rows() -> list[Row]:
    tiny = dict(Hq=4, Hkv=2, D=16)
    return [Row("decode", 2, 64, 16, "bfloat16", **tiny), Row("decode", 1, 64, 32, "float16", **tiny),
            Row("prefill", 1, 64, 16, "bfloat16", **tiny),
            Row("prefill", 1, 4096, 16, "bfloat16", **tiny)]  # minutes in the interpreter: the budget skips it
