"""Shared benchmark protocol: warm-up, repeats, median and spread, JSON as the last line."""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "mps":
        return f"Apple {platform.machine()} (MPS)"
    return f"{platform.processor() or platform.machine()} CPU x{torch.get_num_threads()} threads"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def measure(fn, repeats: int, warmup: int = 1, device: torch.device | None = None, label: str = "") -> dict:
    """Run fn() warmup + repeats times; fn returns a number (its own metric) or None to time it."""
    values = []
    for i in range(warmup + repeats):
        if device is not None:
            sync(device)
        t0 = time.perf_counter()
        out = fn()
        if device is not None:
            sync(device)
        value = out if out is not None else (time.perf_counter() - t0) * 1000.0
        if i >= warmup:
            values.append(value)
        print(f"  {label} run {i + 1}/{warmup + repeats}{' (warm-up)' if i < warmup else ''}: {value:.2f}",
              file=sys.stderr, flush=True)
    return summary(values)


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "stdev": statistics.stdev(values) if len(values) > 1 else 0.0, "n": len(values)}


def versions() -> dict:
    import transformers

    import kvtool

    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "kvtool": kvtool.__version__}


def emit(record: dict, out: str | None) -> None:
    line = json.dumps(record)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {out}", file=sys.stderr)
    print(line)
