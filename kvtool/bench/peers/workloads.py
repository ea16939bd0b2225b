"""The workloads `kvtool bench peers` runs against every engine's OpenAI API, the same requests for each:
decode at batch 1, cold TTFT, a prefix hit, N concurrent streams, the context layouts of `bench ttft`, and vLLM's
own `bench serve` client on the loads of config.CLIENT_LOADS (vllm_client).

Prompts are token ids (POST /v1/completions takes them on kvtool serve, llama-server and vLLM), drawn at
random with ids below 32000 (batching.random_prompts), fresh for every cold request so no engine's cache
can serve them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kvtool.bench.backends import sse_chunks
from kvtool.bench.peers.config import CLIENT_LOADS
from kvtool.bench.peers.vllm_client import workload as client_workload
from kvtool.bench.protocol import measure


@dataclass
class Endpoint:
    client: object  # httpx.Client on the server's base URL
    base: str
    model: str
    pid: int | None = None  # the server process (its tree's memory is the memory row)
    folder: str | None = None  # the HF folder: the tokenizer vLLM's client loads
    out_dir: str | None = None  # where a workload keeps its files
    label: str = "engine"  # engine and round, for those files' names


class TokenSource:
    """Random token-id prompts, each new one different from every earlier one (a seeded generator)."""

    def __init__(self, seed: int, vocab: int = 32000):
        self.gen, self.vocab = torch.Generator().manual_seed(seed), vocab

    def __call__(self, n: int) -> list[int]:
        return torch.randint(100, self.vocab - 1, (n,), generator=self.gen).tolist()


def complete(ep: Endpoint, prompt: list[int], max_tokens: int) -> dict:
    """One streamed greedy /v1/completions (ignore_eos): time to the first text chunk, chunk times (ms from
    the request), the tokens generated, the prompt tokens the engine says it served from its cache and the
    engine's own `timings` when it sends them (kvtool serve, llama-server)."""
    body = {"model": ep.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0, times, usage, timings = time.perf_counter(), [], {}, {}
    with ep.client.stream("POST", "/v1/completions", json=body) as r:
        for chunk in sse_chunks(r, f"{ep.base}/v1/completions"):
            if any(c.get("text") for c in chunk.get("choices") or []):
                times.append((time.perf_counter() - t0) * 1000.0)
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings  # llama-server
    end = (time.perf_counter() - t0) * 1000.0
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is None:
        cached = timings.get("cache_n")
    return {"ttft_ms": times[0] if times else end, "times_ms": times, "end_ms": end,
            "tokens": usage.get("completion_tokens") or len(times), "prompt_tokens": usage.get("prompt_tokens"),
            "cached_tokens": cached, "timings": timings}


def decode_rate(result: dict) -> float:
    """Tokens/s from the first streamed token to the last (the prefill left out)."""
    times = result["times_ms"]
    if len(times) < 2 or times[-1] <= times[0]:
        raise RuntimeError(f"the engine streamed {len(times)} chunks for {result['tokens']} tokens; a decode rate "
                           "needs at least two")
    # an engine that sends several tokens in one chunk still spends the time between its first and last chunk
    # on all but the first chunk's tokens; count those as the chunks' share of the tokens
    per_chunk = result["tokens"] / len(times)
    return (result["tokens"] - per_chunk) / ((times[-1] - times[0]) / 1000.0)


def decode_b1(ep: Endpoint, cfg, prompts: TokenSource, log) -> dict:
    prompt = prompts(cfg.prompt_tokens)
    log(f"  decode: {cfg.decode_tokens} tokens at batch 1")
    return {"decode_tok_s": measure(lambda: decode_rate(complete(ep, prompt, cfg.decode_tokens)), cfg.repeats,
                                    cfg.warmup, label="decode tok/s")}


def cold_ttft(ep: Endpoint, cfg, prompts: TokenSource, log) -> dict:
    out = {}
    for length in cfg.ttft_lengths:
        log(f"  cold TTFT at {length} tokens")
        out[f"ttft_ms_{length}"] = measure(lambda: complete(ep, prompts(length), 1)["ttft_ms"], cfg.repeats,
                                           cfg.warmup, label=f"cold TTFT @{length} (ms)")
    return out


def prefix_hit(ep: Endpoint, cfg, prompts: TokenSource, log) -> dict:
    """The prefix sent once with one suffix, then with a new suffix each run: TTFT and the cached tokens."""
    prefix = prompts(cfg.prefix_tokens)
    complete(ep, prefix + prompts(cfg.suffix_tokens), 1)
    cached: list[int | None] = []

    def hit():
        res = complete(ep, prefix + prompts(cfg.suffix_tokens), 1)
        cached.append(res["cached_tokens"])
        return res["ttft_ms"]

    log(f"  prefix hit: {cfg.prefix_tokens} cached + {cfg.suffix_tokens} new tokens")
    ms = measure(hit, cfg.repeats, cfg.warmup, label="prefix hit TTFT (ms)")
    known = [c for c in cached[cfg.warmup:] if c is not None]
    return {"prefix_hit_ms": ms, "prefix_cached_tokens": min(known) if known else None,
            "prefix_prompt_tokens": cfg.prefix_tokens + cfg.suffix_tokens}


def streams(ep: Endpoint, cfg, prompts: TokenSource, log) -> dict:
    """N concurrent streams through batching.run_endpoint, its engine_result per N."""
    from kvtool.bench.batching import engine_result, random_prompts, run_endpoint

    out = {}
    for n in cfg.streams:
        batch = random_prompts(n, cfg.stream_prompt_tokens, 32000, seed=int(prompts(1)[0]))
        log(f"  {n} concurrent streams x {cfg.stream_tokens} tokens")
        run_endpoint(ep.client, ep.base, ep.model, batch[:1], min(4, cfg.stream_tokens))
        runs = []
        for i in range(cfg.repeats):
            runs.append(run_endpoint(ep.client, ep.base, ep.model, batch, cfg.stream_tokens))
            log(f"    run {i + 1}/{cfg.repeats}: {runs[-1].tokens / runs[-1].wall_s:.1f} tok/s")
        out[f"streams_{n}"] = engine_result(runs)
    return out


def layouts(ep: Endpoint, cfg, prompts: TokenSource, log) -> dict:
    """`bench ttft`'s context-layout scenarios through its EndpointBackend (chat requests)."""
    from kvtool.bench.backends import EndpointBackend
    from kvtool.bench.scenarios import ScenarioConfig
    from kvtool.bench.ttft import TTFTBenchConfig, run_ttft_bench

    # the same prompt bytes for every engine: each scenario isolated by a nonce at the start of the system prompt
    # (llama-server has no cache-reset route; a reset on the others would spare them the nonce's tokens and so
    # change their prompts and shares), and tools declared in the system turn, not left to each server's
    # template handling (llama-server renders SmolLM2's template without them, kvtool serve refuses them)
    backend = EndpointBackend(ep.base, ep.model, client=ep.client, reset_cache=False)
    backend.tools_rendering = "system-text"
    record = run_ttft_bench(backend, TTFTBenchConfig(scenarios=cfg.scenarios, out=None),
                            ScenarioConfig(requests=cfg.scenario_requests, policy_paragraphs=cfg.policy_paragraphs,
                                           tools=cfg.tools), log=lambda s: log(f"  {s}"),
                            run_id=f"{prompts(1)[0]:08x}")  # one nonce for every engine: each has a fresh server
    keep = ("number", "expect", "requests", "ttft_ms_p50", "ttft_ms_p90", "ttft_ms_first", "ttft_ms_later_p50",
            "hit_rate", "hit_rate_after_first", "prompt_tokens_mean")
    return {"layouts": {row["name"]: {k: row[k] for k in keep} for row in record["scenarios"]},
            "layouts_tools_rendering": backend.tools_rendering, "layouts_isolation": record["isolation"]}


def memory(ep: Endpoint, cfg, prompts: TokenSource, log) -> dict:
    """One streamed request (the decode workload's prompt length, 16 new tokens), then the resident memory of the
    server's process tree."""
    from kvtool.bench.peers.memory import tree_rss

    if ep.pid is None:
        raise RuntimeError("no server process to measure: the engine runs in this process")
    complete(ep, prompts(cfg.prompt_tokens), min(16, cfg.decode_tokens))
    row = tree_rss(ep.pid)
    log(f"  memory after one request: RSS {row['rss_mib']:.0f} MiB, PSS {row['pss_mib']:.0f} MiB in "
        f"{row['processes']} processes {row['by_name']}")
    return {"memory": row}


WORKLOADS = {"memory": memory, "decode": decode_b1, "ttft": cold_ttft, "prefix": prefix_hit, "streams": streams,
             "layouts": layouts, **{name: client_workload(name) for name in ("vllm-bench", *CLIENT_LOADS)}}
