"""`kvtool bench batching`: N concurrent greedy streams of M new tokens each, continuous batching vs baselines.

kvtool: a BatchScheduler in this process, every stream submitted at once (ignore_eos, so each runs M tokens).
Baselines in the same run, on the same random prompts: transformers `generate` on a left-padded batch,
kvtool single-stream Engine.generate over the first --sequential-streams prompts one after another, and with
--endpoint any OpenAI-compatible server (kvtool serve, vLLM, llama.cpp) sent the same token prompts as
concurrent streaming /v1/completions requests. Per engine: aggregate output tok/s (all tokens / wall time),
inter-token latency p50/p99 (gaps between one stream's tokens; endpoint: between text chunks), TTFT p50/p99.

    kvtool bench batching --streams 4 --new-tokens 16                  # CPU smoke test
    kvtool bench batching --shape qwen3-0.6b                           # GPU target: 64 x 256
    kvtool bench batching --shape qwen3-0.6b --endpoint http://127.0.0.1:8000/v1
"""

from __future__ import annotations

import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import torch

from kvtool.bench.protocol import device_name, emit, percentile, summary, sync, versions
from kvtool.bench.targets import Target, check_all
from kvtool.config import SamplingParams
from kvtool.errors import InvalidParameterError

TARGET_SHAPE = (64, 256)  # streams x new tokens the targets are set for
TARGETS = [Target("tok_s", "aggregate output tok/s, 64 x 256", ">=", 15000, "tok/s"),
           Target("itl_ms_p99", "inter-token latency p99, 64 streams", "<=", 25, "ms")]
ENGINES = {"kvtool": "kvtool (batched)", "kvtool_sequential": "kvtool (sequential)",
           "transformers": "transformers (padded batch)", "endpoint": "endpoint"}


@dataclass
class BatchingBenchConfig:
    streams: int = 64
    new_tokens: int = 256
    prompt_tokens: int = 32  # random prompts of prompt_tokens // 2 .. prompt_tokens tokens
    max_running: int | None = None  # None: every stream at once
    prefill_budget: int | None = None  # None: the scheduler's default
    repeats: int = 3
    sequential_streams: int = 4  # single-stream kvtool baseline over the first k prompts (0: skip)
    baseline: bool = True  # transformers padded batch
    seed: int = 0
    temperature: float = 0.0  # 0: greedy (outputs compared across engines); > 0: every engine samples
    out: str | None = None
    png: str | None = None

    def validate(self, max_position: int | None = None) -> "BatchingBenchConfig":
        for name in ("streams", "new_tokens", "prompt_tokens", "repeats"):
            if getattr(self, name) < 1:
                raise InvalidParameterError(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(self, name)})")
        for name in ("max_running", "prefill_budget"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise InvalidParameterError(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(self, name)})")
        if not 0 <= self.sequential_streams <= self.streams:
            raise InvalidParameterError(f"--sequential-streams must be in [0, --streams={self.streams}] "
                                        f"(got {self.sequential_streams})")
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidParameterError(f"--temperature must be in [0, 100] (got {self.temperature})")
        if max_position is not None and self.prompt_tokens + self.new_tokens >= max_position:
            raise InvalidParameterError(f"--prompt-tokens + --new-tokens ({self.prompt_tokens + self.new_tokens}) "
                                        f"must stay below the model's context window of {max_position}")
        return self


def add_args(p) -> None:
    c = BatchingBenchConfig()
    p.add_argument("--streams", type=int, default=c.streams, help="concurrent streams")
    p.add_argument("--new-tokens", type=int, default=c.new_tokens, help="tokens generated per stream")
    p.add_argument("--prompt-tokens", type=int, default=c.prompt_tokens, help="longest random prompt")
    p.add_argument("--max-running", type=int, default=c.max_running, help="scheduler batch limit (default: all)")
    p.add_argument("--prefill-budget", type=int, default=c.prefill_budget, help="prefill tokens per scheduler step")
    p.add_argument("--repeats", type=int, default=c.repeats, help="timed runs per engine after a warm-up")
    p.add_argument("--sequential-streams", type=int, default=None,
                   help=f"streams the single-stream baseline runs one after another (0: skip; default: "
                        f"{c.sequential_streams}, or --streams when fewer)")
    p.add_argument("--temperature", type=float, default=c.temperature,
                   help="0: greedy, outputs compared; > 0: every engine samples at this temperature")
    p.add_argument("--no-baseline", dest="baseline", action="store_false", help="skip transformers")
    p.add_argument("--out", default=c.out, help="also write the JSON record here")
    p.add_argument("--png", default=c.png, help="write a throughput/latency chart here")


def config_from_args(args) -> BatchingBenchConfig:
    return BatchingBenchConfig(streams=args.streams, new_tokens=args.new_tokens, prompt_tokens=args.prompt_tokens,
                               max_running=args.max_running, prefill_budget=args.prefill_budget,
                               repeats=args.repeats,
                               sequential_streams=min(BatchingBenchConfig.sequential_streams, args.streams)
                               if args.sequential_streams is None else args.sequential_streams,
                               baseline=args.baseline, temperature=args.temperature, out=args.out, png=args.png)


@dataclass
class Run:
    times_ms: list[list[float]]  # per stream: arrival of each token (chunk), ms since that request was sent
    wall_s: float
    tokens: int
    token_ids: list[list[int]] = field(default_factory=list)
    steps: int = 0  # kvtool batched: scheduler steps, and the time they spent outside the forward and token read
    host_s: float = 0.0


def random_prompts(n: int, longest: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Ids below 32000 - 1 so an endpoint serving another model (any vocab >= 32k) takes the same prompts."""
    gen = torch.Generator().manual_seed(seed)
    lo, hi = min(100, vocab // 4), min(vocab, 32000) - 1
    lengths = torch.randint(max(1, longest // 2), longest + 1, (n,), generator=gen).tolist()
    return [torch.randint(lo, hi, (k,), generator=gen).tolist() for k in lengths]


def run_batched(engine, prompts, new_tokens: int, cfg: BatchingBenchConfig) -> Run:
    from kvtool.engine.scheduler import BatchScheduler

    opts = {"max_running": cfg.max_running or len(prompts), "prefill_budget": cfg.prefill_budget}
    sched = BatchScheduler(engine, **{k: v for k, v in opts.items() if v is not None})
    params = SamplingParams(temperature=cfg.temperature, max_tokens=new_tokens, ignore_eos=True)
    times: list[list[float]] = [[] for _ in prompts]
    sync(engine.runner.device)
    t0 = time.perf_counter()
    gens = [sched.submit(p, params, on_event=lambda e, i=i: times[i].append(e.t_ms)) for i, p in enumerate(prompts)]
    sched.run()
    sync(engine.runner.device)
    wall = time.perf_counter() - t0
    # TokenEvent.t_ms counts from admission; add the queue wait so every time counts from submission
    times = [[g.timings.queue_ms + t for t in ts] for g, ts in zip(gens, times)]
    return Run(times, wall, sum(len(g.token_ids) for g in gens), [g.token_ids for g in gens], sched.steps,
               sched.host_s)


def run_sequential(engine, prompts, new_tokens: int, temperature: float = 0.0) -> Run:
    params = SamplingParams(temperature=temperature, max_tokens=new_tokens, ignore_eos=True)
    times, ids = [], []
    t0 = time.perf_counter()
    for p in prompts:
        gen = engine.generate(p, params)
        times.append([e.t_ms for e in gen])
        ids.append(gen.token_ids)
    return Run(times, time.perf_counter() - t0, sum(map(len, ids)), ids)


def run_transformers(hf, prompts, new_tokens: int, temperature: float = 0.0) -> Run:
    """One generate() over the left-padded batch; a streamer timestamps each step (the same for every stream)."""
    from transformers.generation.streamers import BaseStreamer

    class StepClock(BaseStreamer):
        def __init__(self):
            self.t0, self.prompt_seen, self.times = 0.0, False, []

        def put(self, value):  # the first put() is the prompt; each later one holds a generated step
            if self.prompt_seen:
                self.times.append((time.perf_counter() - self.t0) * 1000.0)
            self.prompt_seen = True

        def end(self):
            pass

    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=hf.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=hf.device)
    clock = StepClock()
    sync(hf.device)
    clock.t0 = time.perf_counter()
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                          pad_token_id=0, streamer=clock,
                          **({"do_sample": True, "temperature": temperature, "top_p": 1.0, "top_k": 0}
                             if temperature > 0 else {"do_sample": False}))
    sync(hf.device)
    wall = time.perf_counter() - clock.t0
    new = out[:, width:].tolist()
    return Run([list(clock.times) for _ in prompts], wall, sum(map(len, new)), new)


def run_endpoint(client, base: str, model: str, prompts, new_tokens: int, temperature: float = 0.0) -> Run:
    """Concurrent streaming /v1/completions (token-id prompts, ignore_eos), one thread per stream."""
    from kvtool.bench.backends import sse_chunks

    start = threading.Barrier(len(prompts))

    def one(prompt):
        body = {"model": model, "prompt": prompt, "max_tokens": new_tokens, "temperature": temperature, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}}
        start.wait()
        t0, times, usage = time.perf_counter(), [], {}
        with client.stream("POST", "/v1/completions", json=body) as r:
            for chunk in sse_chunks(r, f"{base}/v1/completions"):
                if any(c.get("text") for c in chunk.get("choices") or []):
                    times.append((time.perf_counter() - t0) * 1000.0)
                usage = chunk.get("usage") or usage
        return t0, time.perf_counter(), times, usage.get("completion_tokens") or len(times)

    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        done = list(pool.map(one, prompts))
    wall = max(d[1] for d in done) - min(d[0] for d in done)
    return Run([d[2] for d in done], wall, sum(d[3] for d in done))


def engine_result(runs: list[Run]) -> dict:
    """Throughput per run (median and spread); latencies pooled over all runs and streams."""
    gaps = [b - a for r in runs for t in r.times_ms for a, b in zip(t, t[1:])]
    firsts = [t[0] for r in runs for t in r.times_ms if t]
    pct = lambda xs, q: percentile(xs, q) if xs else None  # noqa: E731  (one-token streams have no gaps)
    out = {"streams": len(runs[0].times_ms), "tokens": runs[0].tokens, "runs": len(runs),
           "tok_s": summary([r.tokens / r.wall_s for r in runs]), "wall_s": summary([r.wall_s for r in runs]),
           "itl_ms_p50": pct(gaps, 50), "itl_ms_p99": pct(gaps, 99),
           "ttft_ms_p50": pct(firsts, 50), "ttft_ms_p99": pct(firsts, 99)}
    if runs[0].steps:  # what the scheduler itself costs per step: the share of the wall time the model does not use
        out["steps"] = runs[0].steps
        out["host_ms_per_step"] = summary([r.host_s * 1000.0 / r.steps for r in runs])
        out["host_share"] = summary([r.host_s / r.wall_s for r in runs])
    return out


def _match(a: list[list[int]], b: list[list[int]]) -> dict:
    return {"compared": len(b), "identical": sum(x == y for x, y in zip(a, b))}


def run_batching_bench(bm, cfg: BatchingBenchConfig | None = None, endpoint: dict | None = None,
                       log=lambda s: print(s, file=sys.stderr, flush=True)) -> dict:
    """kvtool continuous batching on ``bm`` (a BenchModel) beside the baselines; returns the JSON record.

    endpoint: {"url", "model" (None: the first of /v1/models), "api_key"} to also load-test a server.
    """
    from kvtool.engine import Engine

    cfg = (cfg or BatchingBenchConfig()).validate(bm.runner.spec.max_position)
    n, m = cfg.streams, cfg.new_tokens
    prompts = random_prompts(n, cfg.prompt_tokens, bm.runner.spec.vocab_size, cfg.seed)
    engine = Engine(bm.model)  # no prefix cache: random prompts share nothing
    warm = min(m, 4)
    log(f"batching: {n} streams x {m} new tokens, prompts of {min(map(len, prompts))}-{max(map(len, prompts))} "
        f"tokens ({bm.name} on {bm.device})")

    def timed(label: str, fn, warmup) -> list[Run]:
        warmup()
        runs = []
        for i in range(cfg.repeats):
            runs.append(fn())
            r = runs[-1]
            log(f"  {label} run {i + 1}/{cfg.repeats}: {r.tokens} tokens in {r.wall_s:.2f} s "
                f"({r.tokens / r.wall_s:.1f} tok/s)")
        return runs

    t = cfg.temperature
    runs = {"kvtool": timed("kvtool batched", lambda: run_batched(engine, prompts, m, cfg),
                            lambda: run_batched(engine, prompts, warm, cfg))}
    if cfg.sequential_streams:
        subset = prompts[: cfg.sequential_streams]
        run_sequential(engine, subset[:1], warm, t)
        runs["kvtool_sequential"] = [run_sequential(engine, subset, m, t)]
        log(f"  kvtool sequential: {cfg.sequential_streams} streams in {runs['kvtool_sequential'][0].wall_s:.2f} s")
    if cfg.baseline:
        hf = bm.hf()
        runs["transformers"] = timed("transformers", lambda: run_transformers(hf, prompts, m, t),
                                     lambda: run_transformers(hf, prompts, warm, t))
    served, errors = None, {}
    if endpoint:  # a failing server is recorded; the in-process results stand
        from kvtool.bench.backends import first_model, open_client

        try:
            base, client = open_client(endpoint["url"], endpoint.get("api_key"), connections=n + 2)
            served = {"url": base, "model": endpoint.get("model") or first_model(client, base)}
            runs["endpoint"] = timed("endpoint", lambda: run_endpoint(client, base, served["model"], prompts, m, t),
                                     lambda: run_endpoint(client, base, served["model"], prompts[:1], warm, t))
        except Exception as exc:
            errors["endpoint"] = f"{type(exc).__name__}: {exc}"
            log(f"  endpoint failed: {errors['endpoint']}")
    results = {name: engine_result(r) for name, r in runs.items()}
    batched = runs["kvtool"][-1].token_ids
    match = {name: _match(batched, r[-1].token_ids) for name, r in runs.items()
             if name in ("kvtool_sequential", "transformers") and t == 0.0}  # sampled outputs differ by design
    k = results["kvtool"]["tok_s"]["median"]
    speedup = {name: k / r["tok_s"]["median"] for name, r in results.items() if name != "kvtool"}
    measured = {"tok_s": k, "itl_ms_p99": results["kvtool"]["itl_ms_p99"]}
    return {"benchmark": "batching", "model": bm.name, "device": device_name(bm.device),
            "device_type": bm.device.type, "dtype": bm.dtype, "config": asdict(cfg),
            "prompt_lengths": [len(p) for p in prompts], "endpoint": served, "results": results,
            "greedy_match": match, "speedup_vs": speedup, "errors": errors,
            "target_checks": check_all(TARGETS, measured, bm.device.type, applies=(n, m) == TARGET_SHAPE and t == 0.0),
            "versions": versions()}


def format_table(record: dict) -> str:
    c = record["config"]
    mode = f"sampled at temperature {c['temperature']}" if c.get("temperature") else "greedy"
    lines = [f"\nbatching: {c['streams']} streams x {c['new_tokens']} new tokens, {mode}: {record['model']} on "
             f"{record['device']}, {record['dtype']}",
             f"{'engine':<30}{'streams':>8}{'tok/s':>10}{'ITL p50':>9}{'p99':>8}{'TTFT p50':>10}{'p99':>8}"]
    ms = lambda x, w: f"{'n/a':>{w}}" if x is None else f"{x:>{w}.1f}"  # noqa: E731
    for name, r in record["results"].items():
        lines.append(f"{ENGINES[name]:<30}{r['streams']:>8}{r['tok_s']['median']:>10.1f}{ms(r['itl_ms_p50'], 9)}"
                     f"{ms(r['itl_ms_p99'], 8)}{ms(r['ttft_ms_p50'], 10)}{ms(r['ttft_ms_p99'], 8)}")
    k = record["results"]["kvtool"]
    if "host_ms_per_step" in k:
        lines.append(f"kvtool scheduler: {k['steps']} steps, {k['host_ms_per_step']['median']:.2f} ms each outside "
                     f"the forward and the token read ({100 * k['host_share']['median']:.0f}% of the wall time)")
    for name, m in record["greedy_match"].items():
        lines.append(f"greedy tokens identical to {ENGINES[name]}: {m['identical']}/{m['compared']} streams")
    lines += [f"{name} failed: {msg}" for name, msg in record["errors"].items()]
    lines.append("latencies in ms; sequential TTFT is per lone request")
    return "\n".join(lines)


def plot(record: dict, path) -> None:
    from kvtool.bench.plots import bar_panels

    res = record["results"]
    panels = {label: {ENGINES[n]: (r[key]["median"] if key == "tok_s" else r[key]) for n, r in res.items()}
              for label, key in (("output tok/s", "tok_s"), ("ITL p50 (ms)", "itl_ms_p50"),
                                 ("ITL p99 (ms)", "itl_ms_p99"), ("TTFT p50 (ms)", "ttft_ms_p50"))}
    c = record["config"]
    bar_panels(path, f"{c['streams']} streams x {c['new_tokens']} tokens: {record['model']} on {record['device']}",
               panels)


def report(record: dict, out: str | None, png: str | None = None) -> None:
    print(format_table(record))
    if png:
        plot(record, png)
        record["png"] = png
        print(f"wrote {png}", file=sys.stderr)
    emit(record, out)
