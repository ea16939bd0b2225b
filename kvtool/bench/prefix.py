"""`kvtool bench prefix`: TTFT of a prefix-cache hit vs a cold prefill, beside transformers.

kvtool hit = PrefixCache.prepare (match + gather + copy into the request's cache) + prefill of
the suffix (ModelRunner.run, the engine's forward on every device) + first token; exactly the Engine's
path, minus scheduling and detokenization.
kvtool cold = prefill of prefix + suffix. kvtool .kvc = a restart: a new PrefixCache loads the saved cache
file, then the hit. The transformers baseline, in the same run: a DynamicCache
holding the prefix is deep-copied (each request needs its own) and the suffix forwarded; its cold run
forwards the whole prompt. Both keep only the last position's logits. A fresh random suffix per
run makes every hit exactly the prefix.

    kvtool bench prefix                                    # SmolLM2 on CPU: 2048 + 64 tokens
    kvtool bench prefix --shape qwen3-0.6b --prefix-tokens 4096 --device cuda   # H200 target
"""

from __future__ import annotations

import copy
import inspect
import sys
import time
from dataclasses import asdict, dataclass

import torch

from kvtool.bench.decode import engine_prefill, kvtool_ttft
from kvtool.bench.protocol import device_name, emit, measure, summary, sync, versions
from kvtool.bench.targets import Target
from kvtool.config import EngineConfig
from kvtool.errors import InvalidParameterError

TARGET_SPEEDUP = 15.0  # 2-core CPU, SmolLM2, 2048 + 64 (transformers DynamicCache reuse: 14.5x)
TARGET_HIT_MS_CUDA = 3.0  # H200, Qwen3-0.6B shape bf16, 4096 + 64
TARGETS = [Target("speedup", "hit vs cold prefill", ">=", TARGET_SPEEDUP, "x", "2-core CPU, SmolLM2, 2048 + 64",
                  device_type=None),
           Target("hit_ms", "prefix hit TTFT", "<=", TARGET_HIT_MS_CUDA, "ms", "H200, Qwen3-0.6B shape, bf16, "
                  "4096 + 64")]


@dataclass
class PrefixBenchConfig:
    prefix_tokens: int = 2048
    suffix_tokens: int = 64
    repeats: int = 3
    warmup: int = 1
    block_size: int = EngineConfig.prefix_block
    prefill_chunk: int = EngineConfig.prefill_chunk
    baseline: bool = True  # also time transformers
    seed: int = 0
    out: str | None = None

    def validate(self) -> "PrefixBenchConfig":
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise InvalidParameterError(f"--block-size must be an integer >= 1, got {self.block_size!r}")
        if self.prefix_tokens < self.block_size or self.prefix_tokens % self.block_size:
            raise InvalidParameterError(f"--prefix-tokens ({self.prefix_tokens}) must be a positive multiple of the "
                                        f"block size ({self.block_size}) so the whole prefix can hit")
        if self.suffix_tokens < 1 or self.repeats < 1 or self.warmup < 0:
            raise InvalidParameterError(f"--suffix-tokens and --repeats must be >= 1 and --warmup >= 0; got "
                                        f"{self.suffix_tokens}, {self.repeats} and {self.warmup}")
        return self


def _kvtool_hit(pc, runner, prompt, chunk, expect_cached, prepare_ms: list | None = None) -> tuple[float, int]:
    t0 = time.perf_counter()
    cache, n, handle = pc.prepare(prompt, runner)
    if prepare_ms is not None:  # the cache's own share of the hit: match + gather + copy
        sync(runner.device)
        prepare_ms.append((time.perf_counter() - t0) * 1000.0)
    n = min(n, len(prompt) - 1)
    cache.truncate(n)
    ms, token = engine_prefill(runner, cache, prompt[n:], chunk, t0)
    pc.commit(handle, prompt[: cache.offset], cache)  # as the engine does, outside the timed part
    if n != expect_cached:
        raise RuntimeError(f"prefix bench: expected a hit of {expect_cached} tokens, got {n}")
    return ms, token


def restart_from_file(pc, runner, prefix, suffixes, cfg) -> dict:
    """A restarted server's first request: a new PrefixCache loads what ``pc`` saved (a .kvc file, in the OS page
    cache), then the hit; timed load included."""
    import tempfile

    from kvtool.cache.manager import PrefixCache

    with tempfile.TemporaryDirectory() as folder:
        saved = pc.save(f"{folder}/prefix.kvc")

        def load_and_hit():
            t0 = time.perf_counter()
            fresh = PrefixCache.for_runner(runner, budget_bytes=pc.budget_bytes, block_size=cfg.block_size)
            fresh.load(saved["path"])
            load_ms = (time.perf_counter() - t0) * 1000.0
            return load_ms + _kvtool_hit(fresh, runner, prefix + next(suffixes), cfg.prefill_chunk,
                                         cfg.prefix_tokens)[0]

        ms = measure(load_and_hit, cfg.repeats, cfg.warmup, runner.device, "kvtool load .kvc + hit")
    return {"file_load_hit_ms": ms, "file_bytes": saved["bytes"], "file_save_ms": saved["ms"]}


def run_prefix_bench(bm, cfg: PrefixBenchConfig | None = None,
                     log=lambda s: print(s, file=sys.stderr, flush=True)) -> dict:
    """Prefix-cache hit vs cold prefill on ``bm`` (a BenchModel), beside transformers; the JSON record."""
    from kvtool.cache.manager import PrefixCache

    cfg, name, runner = (cfg or PrefixBenchConfig()).validate(), bm.name, bm.runner
    if cfg.prefix_tokens + cfg.suffix_tokens + 1 > runner.spec.max_position:
        raise InvalidParameterError(f"{cfg.prefix_tokens} + {cfg.suffix_tokens} tokens exceed the model's context "
                                    f"window of {runner.spec.max_position}")
    device, vocab = runner.device, runner.spec.vocab_size
    gen = torch.Generator().manual_seed(cfg.seed)
    prefix = torch.randint(100, vocab - 100, (cfg.prefix_tokens,), generator=gen).tolist()
    suffixes = iter(torch.randint(100, vocab - 100, (1000, cfg.suffix_tokens), generator=gen).tolist())
    cold_prompt = prefix + next(suffixes)
    kv_bytes = runner.spec.kv_bytes_per_token(torch.empty((), dtype=runner.dtype).element_size())
    n_runs = cfg.warmup + cfg.repeats + 2
    pc = PrefixCache.for_runner(runner, budget_bytes=2 * kv_bytes * (cfg.prefix_tokens + cfg.suffix_tokens * n_runs),
                                block_size=cfg.block_size)
    log(f"prefix bench: {name}, {cfg.prefix_tokens} cached + {cfg.suffix_tokens} new tokens on {device}")
    pc.pin(prefix)  # prefills the prefix once and keeps it
    prepare_ms: list[float] = []

    def hit():
        return _kvtool_hit(pc, runner, prefix + next(suffixes), cfg.prefill_chunk, cfg.prefix_tokens, prepare_ms)[0]

    results = {"kvtool": {
        "cold_ms": measure(lambda: kvtool_ttft(runner, cold_prompt, cfg.prefill_chunk), cfg.repeats,
                           cfg.warmup, device, "kvtool cold"),
        "hit_ms": measure(hit, cfg.repeats, cfg.warmup, device, "kvtool hit"),
    }}
    results["kvtool"]["prepare_ms"] = summary(prepare_ms[cfg.warmup:])
    results["kvtool"].update(restart_from_file(pc, runner, prefix, suffixes, cfg))
    # the hit path's first token equals a cold prefill's on the same prompt (fp32: exact; bf16: near ties may flip)
    check_prompt = prefix + next(suffixes)
    cache = runner.new_cache(len(check_prompt) + 1)
    cold_token = int(runner.prefill(check_prompt, cache, chunk=cfg.prefill_chunk).argmax(-1))
    first_token_match = _kvtool_hit(pc, runner, check_prompt, cfg.prefill_chunk, cfg.prefix_tokens)[1] == cold_token
    if cfg.baseline:
        results["transformers"] = transformers_baseline(bm.hf(), prefix, cold_prompt, suffixes, cfg, log)
    for r in results.values():
        r["speedup"] = r["cold_ms"]["median"] / r["hit_ms"]["median"]
    results["kvtool"]["file_speedup"] = results["kvtool"]["cold_ms"]["median"] / results["kvtool"][
        "file_load_hit_ms"]["median"]
    k = results["kvtool"]
    targets = {"hit_speedup_min": TARGET_SPEEDUP, "hit_speedup_met": k["speedup"] >= TARGET_SPEEDUP}
    if device.type == "cuda":
        targets.update(hit_ms_max=TARGET_HIT_MS_CUDA, hit_ms_met=k["hit_ms"]["median"] <= TARGET_HIT_MS_CUDA)
    record = {"benchmark": "prefix", "model": name, "device": device_name(device), "device_type": device.type,
              "dtype": str(runner.dtype).replace("torch.", ""), "config": asdict(cfg), "results": results,
              "first_token_match": first_token_match,
              "targets": targets, "cache": pc.stats(),
              "target_checks": [TARGETS[0].check(k["speedup"], device.type, cfg.prefix_tokens >= 2048),
                                TARGETS[1].check(k["hit_ms"]["median"], device.type, cfg.prefix_tokens >= 4096)],
              "versions": versions()}
    if "transformers" in results:
        record["hit_vs_transformers_hit"] = results["transformers"]["hit_ms"]["median"] / k["hit_ms"]["median"]
    return record


def transformers_baseline(hf, prefix, cold_prompt, suffixes, cfg, log) -> dict:
    device = hf.device
    log("transformers: DynamicCache holding the prefix, deep-copied per request")
    # transformers 5 renamed past_key_values to cache; use whichever this version takes
    cache_kw = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    with torch.inference_mode():
        out = hf(torch.tensor([prefix], device=device), use_cache=True, logits_to_keep=1)
        prefix_cache = out.past_key_values if getattr(out, "cache", None) is None else out.cache

        def cold():
            t0 = time.perf_counter()
            ids = torch.tensor([cold_prompt], device=device)
            int(hf(ids, use_cache=True, logits_to_keep=1).logits[0, -1].argmax())
            return (time.perf_counter() - t0) * 1000.0

        def hit():
            ids = torch.tensor([next(suffixes)], device=device)
            sync(device)
            t0 = time.perf_counter()
            cache = copy.deepcopy(prefix_cache)
            int(hf(ids, **{cache_kw: cache}, use_cache=True, logits_to_keep=1).logits[0, -1].argmax())
            return (time.perf_counter() - t0) * 1000.0

        results = {"cold_ms": measure(cold, cfg.repeats, cfg.warmup, device, "transformers cold"),
                   "hit_ms": measure(hit, cfg.repeats, cfg.warmup, device, "transformers hit")}
    return results


def format_table(record: dict) -> str:
    c = record["config"]
    lines = [f"prefix-cache hit vs cold prefill: {record['model']} on {record['device']}, {record['dtype']}, "
             f"{c['prefix_tokens']} cached + {c['suffix_tokens']} new tokens",
             f"{'engine':<14}{'cold ms':>10}{'hit ms':>10}{'hit spread':>18}{'speedup':>9}"]
    for engine, r in record["results"].items():
        h = r["hit_ms"]
        spread = f"{h['min']:.2f}-{h['max']:.2f}"
        lines.append(f"{engine:<14}{r['cold_ms']['median']:>10.1f}{h['median']:>10.2f}{spread:>18}"
                     f"{r['speedup']:>8.1f}x")
    k = record["results"]["kvtool"]
    if "file_load_hit_ms" in k:
        f = k["file_load_hit_ms"]
        spread = f"{f['min']:.2f}-{f['max']:.2f}"
        lines.append(f"{'kvtool .kvc':<14}{'':>10}{f['median']:>10.2f}{spread:>18}"
                     f"{k['file_speedup']:>8.1f}x   (restart: load the saved cache, {k['file_bytes'] / 1e6:.0f} MB, "
                     "then hit)")
    t = record["targets"]
    lines.append(f"target: kvtool hit >= {t['hit_speedup_min']:.0f}x faster than cold: "
                 f"{'met' if t['hit_speedup_met'] else 'NOT met'}"
                 + (f"; hit <= {t['hit_ms_max']} ms: {'met' if t['hit_ms_met'] else 'NOT met'}"
                    if "hit_ms_max" in t else ""))
    return "\n".join(lines)


def report(record: dict, out: str | None) -> None:
    print(format_table(record))
    emit(record, out)
