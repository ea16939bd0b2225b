"""Requests that share a long system prompt and arrive while the first is still decoding: is its prompt reused?

    python benchmarks/shared_prefix.py                    # embedded SmolLM2, 6 requests 0.5 s apart
    python benchmarks/shared_prefix.py --requests 8 --gap 0.25 --model path/to/model.gguf

A BatchScheduler with a prefix cache runs k chat requests (one ~1,000-token system prompt, a
different question each, 48 greedy tokens), request i submitted i x gap seconds after the first.
kvtool caches a prompt's KV as soon as its prefill ends (PrefixCache.publish), so a request
arriving while an earlier one decodes reuses the system prompt; the baseline, in the same run,
is the same engine caching a request's KV only when it finishes (publish disabled), which is
what it did before. Both sides alternate, each with an empty cache, and must produce the same
tokens. Reports the TTFT of requests 2..k (submit to first token, queueing included), prompt
tokens served from the cache, and the wall time until all are done; median and spread; JSON last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvtool.bench.protocol import repeat_words, summary, versions  # noqa: E402

SYSTEM = ("You are the support assistant of a hardware shop. Policies: returns within 30 days with a receipt; "
          "store credit after that; power tools are tested before resale; delivery is free above 50 euros. ")
QUESTIONS = ["Can I return a drill after six weeks?", "Is delivery free for a 45 euro order?",
             "Do you test used saws?", "What do I need to return a lamp?", "Can I get store credit?",
             "How long do returns take?", "Do you sell paint?", "Is there a fee for delivery above 60 euros?"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=6)
    p.add_argument("--gap", type=float, default=0.5, help="seconds between arrivals")
    p.add_argument("--system-words", type=int, default=700)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    p.add_argument("--out", default=None, help="also write the JSON record here")
    return p.parse_args(argv)


def prompts(model, k: int, words: int) -> list[list[int]]:
    system = repeat_words(SYSTEM, words)
    return [model.encode_chat([{"role": "system", "content": system},
                               {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}])
            for i in range(k)]


def one_run(engine, ids: list[list[int]], gap: float, max_tokens: int, share: bool) -> dict:
    from kvtool import SamplingParams
    from kvtool.cache.manager import attach_prefix_cache
    from kvtool.engine.scheduler import BatchScheduler

    cache = attach_prefix_cache(engine, budget_bytes=1 << 30)
    if not share:
        cache.publish = lambda *args: None  # the baseline: a request's KV is cached when it finishes
    sched = BatchScheduler(engine, max_running=len(ids), prefill_budget=engine.config.prefill_chunk)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    gens, t0 = [], time.perf_counter()
    while len(gens) < len(ids) or not sched.idle:
        if len(gens) < len(ids) and time.perf_counter() - t0 >= len(gens) * gap:
            gens.append(sched.submit(ids[len(gens)], params))
            continue
        if sched.idle:
            time.sleep(0.001)
        else:
            sched.step()
    wall = time.perf_counter() - t0
    later = gens[1:]
    return {"ttft_ms": statistics.mean(g.timings.queue_ms + g.timings.ttft_ms for g in later),
            "cached_tokens": sum(g.timings.cached_tokens for g in later), "wall_s": wall,
            "tokens": [g.token_ids for g in gens]}


def main(argv=None) -> int:
    args = parse_args(argv)
    import kvtool
    from kvtool.engine import Engine
    from kvtool.models.embedded import smollm2_path

    model = kvtool.load(args.model or str(smollm2_path()))
    engine = Engine(model)
    ids = prompts(model, args.requests, args.system_words)
    sides = {"prompt shared when prefilled": True, "cached at finish (baseline)": False}
    one_run(engine, ids[:2], 0.0, 4, True)  # warm-up
    runs = {name: [] for name in sides}
    for r in range(args.repeats):
        print(f"round {r + 1}/{args.repeats}", file=sys.stderr, flush=True)
        for name, share in sides.items():
            runs[name].append(one_run(engine, ids, args.gap, args.max_tokens, share))
    same = all(a["tokens"] == b["tokens"] for a, b in zip(*runs.values()))
    results = {name: {key: summary([x[key] for x in rs]) for key in ("ttft_ms", "cached_tokens", "wall_s")}
               for name, rs in runs.items()}
    ours, base = results.values()
    record = {"benchmark": "shared_prefix", "model": model.name, "device": model.info.get("device"),
              "dtype": model.info.get("dtype"), "requests": args.requests, "gap_s": args.gap,
              "prompt_tokens": [len(p) for p in ids], "max_tokens": args.max_tokens, "repeats": args.repeats,
              "results": results, "same_tokens": same,
              "ttft_speedup": round(base["ttft_ms"]["median"] / ours["ttft_ms"]["median"], 3),
              "wall_speedup": round(base["wall_s"]["median"] / ours["wall_s"]["median"], 3), "versions": versions()}
    for name, row in results.items():
        print(f"{name:<30} TTFT of requests 2..k {row['ttft_ms']['median']:7.0f} ms ({row['ttft_ms']['min']:.0f}-"
              f"{row['ttft_ms']['max']:.0f}), cached prompt tokens {row['cached_tokens']['median']:.0f}, "
              f"all done {row['wall_s']['median']:.2f} s")
    print(f"TTFT {record['ttft_speedup']}x, wall {record['wall_speedup']}x; same tokens: {same}")
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
