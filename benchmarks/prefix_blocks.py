"""A prefix-cache hit on the C++ CPU path reading the cached blocks in place (KVCache.paged) beside the same
hit copied into buffers the request owns (what every hit did before, and what the reference forward still gets),
alternating run by run, on the model's own weights: the hit's TTFT (the lookup, then the prefill of the new
tokens), a decode step of `--rows` requests that each hit the same prefix, and the KV bytes the requests hold
beyond the cache's own blocks. Then `--rows` choices of one prompt (n > 1) through the scheduler: the copy of
the prompt's KV each choice starts from reads the prompt's cached blocks in place (PrefixCache.fork), beside
whole copies (a hook without fork): the time until every choice has its first token, and the KV they own.
JSON record as the last line.

    python benchmarks/prefix_blocks.py --model qwen25 --threads 1 --prefix 2048 --suffix 64 --rows 4
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from kvtool.bench.loading import load_bench_model
from kvtool.bench.protocol import device_name, emit, measure_side_by_side, paired_speedup, versions
from kvtool import SamplingParams
from kvtool.cache.manager import PrefixCache
from kvtool.engine import Engine
from kvtool.engine.forks import Fork
from kvtool.engine.scheduler import BatchScheduler


class WholeForks:
    """The prefix cache as a hook without fork(): the n choices of a prompt start from whole copies of its KV."""

    def __init__(self, cache: PrefixCache):
        self.prepare, self.publish, self.commit = cache.prepare, cache.publish, cache.commit


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--prefix", type=int, default=2048, help="tokens the cache holds (whole blocks of 16)")
    p.add_argument("--suffix", type=int, default=64, help="new tokens after the prefix")
    p.add_argument("--rows", type=int, default=4, help="requests in the decode step, each over its own hit")
    p.add_argument("--steps", type=int, default=8, help="decode steps per run (their median is the run's)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.prefix < 16 or args.suffix < 1 or args.rows < 1 or args.steps < 1 or args.repeats < 1:
        p.error("--prefix needs one block (16 tokens), and --suffix, --rows, --steps, --repeats at least 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    bm = load_bench_model(args.model, device="cpu", dtype="float32", announce=lambda s: print(s, file=sys.stderr))
    runner = bm.runner
    if not runner.cpu_decode:
        raise SystemExit("the C++ CPU ops do not run this model here: no in-place hit to time")
    gen = torch.Generator().manual_seed(0)
    vocab = min(runner.spec.vocab_size, 30000)
    prefix = torch.randint(100, vocab, (args.prefix,), generator=gen).tolist()
    suffixes = [torch.randint(100, vocab, (args.suffix,), generator=gen).tolist() for _ in range(args.rows)]
    s = runner.spec
    cache = PrefixCache(s.num_layers, s.num_kv_heads, s.head_dim, budget_bytes=4 << 30, dtype=runner.dtype,
                        runner=runner)
    print(f"caching a {args.prefix}-token prefix", file=sys.stderr)
    cache.pin(prefix)
    sides = ("in_place", "copied")
    held: dict[str, list] = {}  # side -> the requests of its last run: (KVCache, next token, hold)
    own_bytes: dict[str, int] = {}

    def release(side: str) -> None:  # the last run's holds on the blocks, adding nothing to the cache
        for kv, _, handle in held.pop(side, []):
            cache.commit(handle, [], kv)

    def open_hit(side: str, prompt: list[int]):  # (KVCache, hold): the blocks read in place, or copied first
        kv, _, handle = cache.prepare(prompt, runner)
        for layer in kv.layers if side == "copied" else ():
            layer.materialize()
        return kv, handle

    def hit(side: str):
        def run():
            release(side)
            t0 = time.perf_counter()
            kv, handle = open_hit(side, prefix + suffixes[0])
            logits = runner.prefill(suffixes[0], kv)
            ms = 1e3 * (time.perf_counter() - t0)
            held[side] = [(kv, int(logits.argmax()), handle)]
            return ms
        return run

    def step(side: str):
        def run():
            release(side)
            rows = []
            for suffix in suffixes:
                kv, handle = open_hit(side, prefix + suffix)
                rows.append((kv, int(runner.prefill(suffix, kv).argmax()), handle))
            held[side] = rows
            own_bytes[side] = sum(t.nbytes for kv, _, _ in rows for layer in kv.layers for t in layer.buffers)
            times = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                out = runner.forward_batch([([token], kv) for kv, token, _ in rows])
                times.append(1e3 * (time.perf_counter() - t0))
                rows = [(kv, int(o.argmax()), h) for (kv, _, h), o in zip(rows, out)]
            return statistics.median(times)
        return run

    with torch.inference_mode():
        print("hit TTFT: in place / copied, alternating", file=sys.stderr)
        ttft = measure_side_by_side({side: hit(side) for side in sides}, args.repeats, 1)
        print(f"decode step of {args.rows} rows: in place / copied, alternating", file=sys.stderr)
        steps = measure_side_by_side({side: step(side) for side in sides}, args.repeats, 1)
    for side in list(held):
        release(side)
    engine, prompt = Engine(bm.model), prefix + suffixes[0]
    hooks = {"in_place": cache, "copied": WholeForks(cache)}
    fork_bytes: dict[str, int] = {}

    def fork(side: str):
        def run():
            engine.prefix_cache = hooks[side]
            sched = BatchScheduler(engine, max_running=args.rows, prefill_budget=len(prompt))
            share = Fork()
            gens = [sched.submit(prompt, SamplingParams(temperature=0, max_tokens=8), shared=share)
                    for _ in range(args.rows)]
            while any(not g.token_ids for g in gens):
                sched.step()
            fork_bytes[side] = sum(t.nbytes for r in sched.running for layer in r.cache.layers for t in layer.buffers)
            sched.run()
            return max(g.timings.ttft_ms for g in gens)  # the choices' TTFT counts from the first's start
        return run

    with torch.inference_mode():
        print(f"{args.rows} choices of one prompt, first tokens: in place / whole copies, alternating", file=sys.stderr)
        forks = measure_side_by_side({side: fork(side) for side in sides}, args.repeats, 1)
    record = {"benchmark": "prefix_blocks", "model": bm.name, "device": device_name(bm.device),
              "threads": torch.get_num_threads(), "load_avg": round(os.getloadavg()[0], 2), "prefix": args.prefix,
              "suffix": args.suffix, "rows": args.rows, "block_size": cache.block_size,
              "hit_ttft_ms": ttft, "step_ms": steps,
              "ttft_speedup": paired_speedup(ttft["in_place"], ttft["copied"], rate=False),
              "step_speedup": paired_speedup(steps["in_place"], steps["copied"], rate=False),
              "request_kv_bytes": own_bytes, "choices_first_tokens_ms": forks,
              "choices_speedup": paired_speedup(forks["in_place"], forks["copied"], rate=False),
              "choices_kv_bytes": fork_bytes, "versions": versions()}
    print(f"\n{bm.name}, {args.prefix} cached + {args.suffix} new tokens, {torch.get_num_threads()} thread(s)")
    for name, ms, x in (("hit TTFT", ttft, record["ttft_speedup"]),
                        (f"decode step, {args.rows} rows", steps, record["step_speedup"]),
                        (f"{args.rows} choices, 1st tokens", forks, record["choices_speedup"])):
        print(f"{name:<22} in place {ms['in_place']['median']:8.1f} ms  copied {ms['copied']['median']:8.1f} ms  "
              f"{x['median']:.2f}x ({x['min']:.2f}-{x['max']:.2f})")
    for what, held, other in ((f"the {args.rows} requests hold beyond the cache's blocks", own_bytes, "copied"),
                              (f"the {args.rows} choices own after their first token", fork_bytes, "whole copies")):
        print(f"KV {what}: in place {held['in_place'] / 2**20:.1f} MiB, {other} {held['copied'] / 2**20:.1f} MiB")
    emit(record, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
