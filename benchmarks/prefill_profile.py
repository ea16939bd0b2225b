"""Where kvtool's cold prefill spends its time: torch.profiler over one prefill of N random tokens (after a
warm-up), the ops grouped by name, self CPU time, beside the wall time of transformers' forward on the same
tokens. JSON record as the last line.

With --prefix P it profiles a prefix hit instead: an Engine with its prefix cache has seen P random tokens
(plus a suffix); each timed request is those P tokens and --tokens new ones, max_tokens 1, so the figure is
the hit's TTFT (lookup, the cached KV made ready, the suffix's prefill); transformers' column is the suffix's
forward over a DynamicCache of the P tokens (copied before the clock starts: no cache handling timed).

    python benchmarks/prefill_profile.py --model smollm2 --tokens 2048
    python benchmarks/prefill_profile.py --model smollm2 --prefix 2048 --tokens 64
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


def _hf_cold(hf, ids: list[int]):
    def forward():
        with torch.inference_mode():
            hf(torch.tensor([ids]), use_cache=True, logits_to_keep=1)

    return forward


def _prefix_hit(bm, hf, prefix_tokens: int, tokens: int, gen: torch.Generator):
    """kvtool's hit, transformers' suffix forward and what must run before it, and the hits' Timings: fresh
    suffix tokens every call."""
    import copy

    from kvtool.cache.manager import attach_prefix_cache
    from kvtool.engine.engine import Engine
    from kvtool.config import SamplingParams

    prefix = torch.randint(100, 32000, (prefix_tokens,), generator=gen).tolist()
    engine = Engine(bm.model)
    attach_prefix_cache(engine)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    suffix = lambda: torch.randint(100, 32000, (tokens,), generator=gen).tolist()  # noqa: E731
    engine.generate(prefix + suffix(), one).run()
    timings: list[dict] = []

    def hit():
        g = engine.generate(prefix + suffix(), one).run()
        timings.append(g.timings.to_dict())
        if g.timings.cached_tokens < prefix_tokens - engine.prefix_cache.block_size:
            raise RuntimeError(f"the prefix cache served {g.timings.cached_tokens} of {prefix_tokens} tokens")
        return g.timings.ttft_ms

    with torch.inference_mode():
        past = hf(torch.tensor([prefix]), use_cache=True, logits_to_keep=1).past_key_values
    state = {}

    def hf_prepare():  # a fresh suffix and a copy of the prefix's cache, before the clock starts
        state["ids"], state["past"] = suffix(), copy.deepcopy(past)

    def hf_suffix():
        with torch.inference_mode():
            hf(torch.tensor([state.pop("ids")]), past_key_values=state.pop("past"), use_cache=True, logits_to_keep=1)

    return hit, hf_suffix, hf_prepare, {"hit_timings": timings}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--top", type=int, default=15, help="ops listed")
    p.add_argument("--prefix", type=int, default=0, help="profile a hit on this many cached tokens (default: "
                   "a cold prefill)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.tokens < 1 or args.prefix < 0 or args.repeats < 1:
        p.error("--tokens and --repeats must be at least 1, --prefix at least 0")
    bm = load_bench_model(args.model, device="cpu", dtype="float32", announce=lambda s: print(s, file=sys.stderr))
    runner, hf = bm.runner, bm.hf()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 32000, (args.tokens,), generator=gen).tolist()
    kvtool_fn, hf_forward, hf_prepare, extra = (
        (lambda: kvtool_ttft(runner, ids, args.tokens), _hf_cold(hf, ids), lambda: None, {}) if not args.prefix
        else _prefix_hit(bm, hf, args.prefix, args.tokens, gen))

    def hf_ms():
        hf_prepare()
        t0 = time.perf_counter()
        hf_forward()
        return (time.perf_counter() - t0) * 1000.0

    wall = measure_side_by_side({"kvtool": kvtool_fn, "transformers": hf_ms}, args.repeats, 1)
    record = {"benchmark": "prefill_profile", "model": bm.name, "device": device_name(bm.device),
              "tokens": args.tokens, "prefix_tokens": args.prefix, "load_avg": round(os.getloadavg()[0], 2),
              "wall_ms": wall, **extra,
              "transformers_vs_kvtool": round(wall["transformers"]["median"] / wall["kvtool"]["median"], 3),
              "kvtool_ops": profile(kvtool_fn, args.top),
              "transformers_ops": (hf_prepare(), profile(hf_forward, args.top))[1], "versions": versions()}
    for engine in ("kvtool", "transformers"):
        print(f"\n{engine}: {wall[engine]['median']:.0f} ms median; self CPU time by op")
        for row in record[f"{engine}_ops"]:
            print(f"  {row['op'][:48]:<48}{row['calls']:>7}{row['self_ms']:>11.1f} ms{100 * row['share']:>7.1f}%")
    emit(record, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
