"""Performance targets, checked against what a run measured (a target never stands in for a result)."""

from __future__ import annotations

from dataclasses import dataclass

GPU_SETUP = "H200-class CUDA GPU, Qwen3-0.6B shape, bf16"


@dataclass(frozen=True)
class Target:
    metric: str  # key of the measured value in the benchmark's record
    label: str
    op: str  # ">=" or "<="
    value: float
    unit: str
    setup: str = GPU_SETUP  # where the target was set
    device_type: str | None = "cuda"  # None: applies on every device

    def check(self, measured: float | None, device_type: str, applies: bool = True) -> dict:
        """A row for the report; status n/a when the target is for another device/setup or nothing was measured."""
        ok = applies and measured is not None and (self.device_type is None or self.device_type == device_type)
        met = ok and (measured >= self.value if self.op == ">=" else measured <= self.value)
        return {"metric": self.metric, "label": self.label, "target": f"{self.op} {self.value:g} {self.unit}",
                "measured": measured, "unit": self.unit, "setup": self.setup,
                "status": "n/a" if not ok else "met" if met else "missed"}


def check_all(targets: list[Target], measured: dict[str, float | None], device_type: str,
              applies: bool = True) -> list[dict]:
    return [t.check(measured.get(t.metric), device_type, applies) for t in targets]
