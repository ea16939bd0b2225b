"""The transformers column of `kvtool bench peers`: the same workloads on the same HF folder, in this process,
through the transformers baselines kvtool's other benchmarks already use (decode.hf_decode_rate,
prefix.transformers_baseline, batching.run_transformers)."""

from __future__ import annotations

import time

import torch

from kvtool.bench.peers.config import CLIENT_LOADS
from kvtool.bench.protocol import measure

NO_CACHE = "transformers keeps no KV cache across requests: nothing to reuse between them"


def load_hf(folder, threads: int):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def _decode(hf, cfg, prompts, log) -> dict:
    from kvtool.bench.decode import hf_decode_rate

    prompt = prompts(cfg.prompt_tokens)
    log(f"  decode: {cfg.decode_tokens} tokens at batch 1")
    return {"decode_tok_s": measure(lambda: hf_decode_rate(hf, prompt, cfg.decode_tokens), cfg.repeats, cfg.warmup,
                                    label="decode tok/s")}


def _ttft(hf, cfg, prompts, log) -> dict:
    from kvtool.bench.decode import hf_generate

    def once(length):
        ids = prompts(length)
        t0 = time.perf_counter()
        hf_generate(hf, ids, 1)
        return (time.perf_counter() - t0) * 1000.0

    out = {}
    for length in cfg.ttft_lengths:
        log(f"  cold TTFT at {length} tokens")
        out[f"ttft_ms_{length}"] = measure(lambda: once(length), cfg.repeats, cfg.warmup,
                                           label=f"cold TTFT @{length} (ms)")
    return out


def _prefix(hf, cfg, prompts, log) -> dict:
    from kvtool.bench.prefix import transformers_baseline

    prefix = prompts(cfg.prefix_tokens)
    suffixes = iter(lambda: prompts(cfg.suffix_tokens), None)
    log(f"  prefix hit: {cfg.prefix_tokens} cached + {cfg.suffix_tokens} new tokens")
    res = transformers_baseline(hf, prefix, prefix + prompts(cfg.suffix_tokens), suffixes, cfg, log)
    # the hit runs on an explicit copy of the prefix's DynamicCache: every prefix token is reused by construction
    return {"prefix_hit_ms": res["hit_ms"], "prefix_cached_tokens": cfg.prefix_tokens,
            "prefix_prompt_tokens": cfg.prefix_tokens + cfg.suffix_tokens}


def _streams(hf, cfg, prompts, log) -> dict:
    from kvtool.bench.batching import engine_result, random_prompts, run_transformers

    out = {}
    for n in cfg.streams:
        batch = random_prompts(n, cfg.stream_prompt_tokens, 32000, seed=int(prompts(1)[0]))
        log(f"  {n} streams x {cfg.stream_tokens} tokens (one left-padded generate)")
        run_transformers(hf, batch[:1], min(4, cfg.stream_tokens))
        runs = [run_transformers(hf, batch, cfg.stream_tokens) for _ in range(cfg.repeats)]
        out[f"streams_{n}"] = engine_result(runs)
    return out


WORKLOADS = {"decode": _decode, "ttft": _ttft, "prefix": _prefix, "streams": _streams}
UNSUPPORTED = {"layouts": NO_CACHE,  # workload -> why this column has none
               "memory": "runs inside the benchmark's own process: no server process tree to measure",
               **{name: "no HTTP server for vLLM's client to call" for name in ("vllm-bench", *CLIENT_LOADS)}}
