"""The benchmark protocol: warm-up, repeated runs, median and spread, JSON as the last line.

benchmarks/common.py re-exports it, so the scripts, `kvtool bench` and
notebooks use one implementation.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from kvtool.version import __version__


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "mps":
        return f"Apple {platform.machine()} (MPS)"
    return f"{platform.processor() or platform.machine()} CPU x{torch.get_num_threads()} threads"


def sync(device: torch.device | None) -> None:
    if device is None:
        return
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def measure(fn, repeats: int, warmup: int = 1, device: torch.device | None = None, label: str = "") -> dict:
    """Run fn() warmup + repeats times; fn returns its own metric (ms) or None to be timed."""
    return measure_side_by_side({label: fn}, repeats, warmup, device)[label]


def measure_side_by_side(fns: dict, repeats: int, warmup: int = 1, device: torch.device | None = None) -> dict:
    """Like measure() for several engines, alternating them run by run (A B A B ...), so a drift of the
    machine (clock, thermals, a neighbour) hits every engine alike instead of whichever ran last."""
    values: dict = {label: [] for label in fns}
    for i in range(warmup + repeats):
        for label, fn in fns.items():
            sync(device)
            t0 = time.perf_counter()
            out = fn()
            sync(device)
            value = out if out is not None else (time.perf_counter() - t0) * 1000.0
            if i >= warmup:
                values[label].append(value)
            print(f"  {label} run {i + 1}/{warmup + repeats}{' (warm-up)' if i < warmup else ''}: {value:.2f}",
                  file=sys.stderr, flush=True)
    return {label: summary(v) for label, v in values.items()}


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "stdev": statistics.stdev(values) if len(values) > 1 else 0.0, "n": len(values), "runs": list(values)}


def paired_speedup(ours: dict, baseline: dict, rate: bool) -> dict:
    """Speedup run by run of two summaries measure_side_by_side() took together (run i of each back to back,
    so a slow spell of the machine hits both): median, min and max over the runs of ours/baseline for a rate
    (tokens/s), baseline/ours for a time. Steadier than the ratio of the medians on a noisy machine."""
    ratios = [a / b if rate else b / a for a, b in zip(ours["runs"], baseline["runs"], strict=True)]
    return {"median": round(statistics.median(ratios), 3), "min": round(min(ratios), 3),
            "max": round(max(ratios), 3), "n": len(ratios)}


def repeat_words(text: str, words: int) -> str:
    """`text` repeated and cut to exactly `words` words: filler of a chosen length for a prompt."""
    pool = text.split()
    return " ".join((pool * (words // len(pool) + 1))[:words])


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100] (numpy's default method)."""
    xs = sorted(values)
    if not xs:
        return float("nan")
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def versions() -> dict:
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "kvtool": __version__}


def portable(value, root: str | None = None):
    """value with every string that is an absolute path under `root` (default: the working directory)
    made relative to it, recursively: a record run in a checkout names its files as the repo does."""
    prefix = os.path.join(root or os.getcwd(), "")
    if isinstance(value, str):
        return value[len(prefix):] if value.startswith(prefix) else value
    if isinstance(value, dict):
        return {k: portable(v, prefix) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [portable(v, prefix) for v in value]
    return value


def emit(record: dict, out: str | Path | None) -> None:
    """Write the record to ``out`` (indented) and print it as one JSON line, last on stdout. Paths under
    the working directory become relative to it (portable()), in the caller's record too."""
    record.update(portable(record))
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {out}", file=sys.stderr)
    print(json.dumps(record), flush=True)
