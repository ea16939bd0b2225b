"""Where kvtool's cold prefill spends its time: torch.profiler over one prefill of N random tokens (after a
warm-up), the ops grouped by name, self CPU time, beside the wall time of transformers' forward on the same
tokens. JSON record as the last line.

    python benchmarks/prefill_profile.py --model smollm2 --tokens 2048
    python benchmarks/prefill_profile.py --model smollm2 --tokens 2048 --out benchmarks/results/prefill-profile-cpu.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from kvtool.bench.decode import kvtool_ttft
from kvtool.bench.loading import load_bench_model
from kvtool.bench.protocol import device_name, emit, measure_side_by_side, versions


def profile(fn, top: int) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in rows) or 1
    return [{"op": e.key, "calls": e.count, "self_ms": round(e.self_cpu_time_total / 1000, 2),
             "share": round(e.self_cpu_time_total / total, 4)} for e in rows[:top]]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--top", type=int, default=15, help="ops listed")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    bm = load_bench_model(args.model, device="cpu", dtype="float32", announce=lambda s: print(s, file=sys.stderr))
    runner, hf = bm.runner, bm.hf()
    ids = torch.randint(100, 32000, (args.tokens,), generator=torch.Generator().manual_seed(0)).tolist()

    def hf_forward():
        with torch.inference_mode():
            hf(torch.tensor([ids]), use_cache=True, logits_to_keep=1)

    def hf_ms():
        t0 = time.perf_counter()
        hf_forward()
        return (time.perf_counter() - t0) * 1000.0

    wall = measure_side_by_side({"kvtool": lambda: kvtool_ttft(runner, ids, args.tokens), "transformers": hf_ms},
                                args.repeats, 1)
    record = {"benchmark": "prefill_profile", "model": bm.name, "device": device_name(bm.device),
              "tokens": args.tokens, "load_avg": round(os.getloadavg()[0], 2), "wall_ms": wall,
              "transformers_vs_kvtool": round(wall["transformers"]["median"] / wall["kvtool"]["median"], 3),
              "kvtool_ops": profile(lambda: kvtool_ttft(runner, ids, args.tokens), args.top),
              "transformers_ops": profile(hf_forward, args.top), "versions": versions()}
    for engine in ("kvtool", "transformers"):
        print(f"\n{engine}: {wall[engine]['median']:.0f} ms median; self CPU time by op")
        for row in record[f"{engine}_ops"]:
            print(f"  {row['op'][:48]:<48}{row['calls']:>7}{row['self_ms']:>11.1f} ms{100 * row['share']:>7.1f}%")
    emit(record, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
