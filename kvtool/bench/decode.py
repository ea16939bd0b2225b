"""`kvtool bench decode`: bs=1 decode tokens/s and cold TTFT, kvtool vs transformers `generate`, same run.

    kvtool bench decode                                    # default model (SmolLM2 offline)
    kvtool bench decode --shape qwen3-0.6b --ttft-lengths 512 4096   # random weights, GPU targets

Decode is also timed through Engine.generate (decode_tok_s_engine: the scheduler's whole step at bs=1, what a
streaming client's time per output token comes from). On a CPU it also times copies of the model with int4 projections (`--weights int4`, decode) and with bf16
weights (`--weights bf16`, decode and TTFT) in the same runs, and records how far each copy's next tokens move
from the dense model's (for bf16 also over one prefill of the prompt and the dense model's greedy tokens).
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass, field

import torch

from kvtool.bench.protocol import device_name, emit, measure_side_by_side, paired_speedup, versions
from kvtool.bench.targets import Target, check_all
from kvtool.config import EngineConfig, SamplingParams
from kvtool.errors import InvalidParameterError

TARGETS = [Target("decode_tok_s", "decode tok/s, bs=1", ">=", 800, "tok/s"),
           Target("ttft_ms_512", "cold TTFT @512", "<=", 6, "ms"),
           Target("ttft_ms_4096", "cold TTFT @4096", "<=", 15, "ms")]


@dataclass
class DecodeBenchConfig:
    decode_tokens: int = 64
    ttft_lengths: list[int] = field(default_factory=lambda: [512, 2048])
    prompt_tokens: int = 32  # prompt before the timed decode steps
    repeats: int = 3
    warmup: int = 1
    prefill_chunk: int = EngineConfig.prefill_chunk
    baseline: bool = True  # also time transformers
    int4: bool = True  # on CPU, also time an int4-projection copy of a dense model (and its fidelity)
    bf16: bool = True  # on CPU, also time a bf16-weight copy (decode and TTFT; its fidelity) where oneDNN runs bf16
    seed: int = 0
    out: str | None = None

    def validate(self, max_position: int | None = None) -> "DecodeBenchConfig":
        if min(self.decode_tokens, self.prompt_tokens, self.repeats, *self.ttft_lengths) < 1 or self.warmup < 0:
            raise InvalidParameterError("--decode-tokens, --prompt-tokens, --repeats and --ttft-lengths must be "
                                        ">= 1 (and --warmup >= 0)")
        longest = max(self.ttft_lengths + [self.prompt_tokens + self.decode_tokens])
        if max_position is not None and longest >= max_position:
            raise InvalidParameterError(f"{longest} tokens do not fit the model's context window of {max_position}; "
                                        "lower --ttft-lengths or --decode-tokens")
        return self


def add_args(p) -> None:
    c = DecodeBenchConfig()
    p.add_argument("--decode-tokens", type=int, default=c.decode_tokens, help="timed greedy decode steps")
    p.add_argument("--ttft-lengths", type=int, nargs="+", default=c.ttft_lengths, help="cold TTFT prompt lengths")
    p.add_argument("--repeats", type=int, default=c.repeats)
    p.add_argument("--no-baseline", dest="baseline", action="store_false", help="skip the transformers baseline")
    p.add_argument("--no-int4", dest="int4", action="store_false",
                   help="skip the int4-projection copy (timed on CPU only)")
    p.add_argument("--no-bf16", dest="bf16", action="store_false", help="skip the bf16-weight copy (CPU only)")
    p.add_argument("--out", default=c.out, help="also write the JSON record here")


def config_from_args(args) -> DecodeBenchConfig:
    return DecodeBenchConfig(decode_tokens=args.decode_tokens, ttft_lengths=args.ttft_lengths, repeats=args.repeats,
                             baseline=args.baseline, int4=args.int4, bf16=args.bf16, out=args.out)


def kvtool_decode(runner, prompt: list[int], n: int) -> float:
    """Tokens/s over n greedy decode steps after a prefill (host sync per token, as when streaming), each step
    one ModelRunner.run: the forward the engine's scheduler runs on every device."""
    cache = runner.new_cache(len(prompt) + n + 1)
    tok = int(runner.prefill(prompt, cache).argmax(-1))
    t0 = time.perf_counter()
    for _ in range(n):
        tok = int(runner(torch.tensor([tok], device=runner.device), cache).argmax(-1))
    return n / (time.perf_counter() - t0)


def engine_decode(engine, prompt: list[int], n: int) -> float:
    """Tokens/s of Engine.generate's n greedy decode steps at bs=1, from its first streamed token to its last: each
    step the scheduler's whole work (its forward over the engine's KV, sampling, detokenizing)."""
    params = SamplingParams(temperature=0, max_tokens=n + 1, ignore_eos=True)
    stamps = [time.perf_counter() for _ in engine.generate(prompt, params)]
    return n / (stamps[-1] - stamps[0])


def engine_prefill(runner, cache, ids: list[int], chunk: int, t0: float | None = None) -> tuple[float, int]:
    """(ms to the first token, its id) as Engine.generate gets them: ids prefilled after what `cache` holds, in
    chunks of `chunk` tokens through ModelRunner.run, and the argmax of the last one's logits."""
    t0 = time.perf_counter() if t0 is None else t0
    token = int(runner.prefill(ids, cache, chunk=chunk).argmax(-1))
    return (time.perf_counter() - t0) * 1000.0, token


def kvtool_ttft(runner, prompt: list[int], chunk: int) -> float:
    t0 = time.perf_counter()
    return engine_prefill(runner, runner.new_cache(len(prompt) + 1), prompt, chunk, t0)[0]


# a record's metric is a base name plus at most one of these suffixes, naming the kvtool variant it measures
VARIANTS = {"_engine": "kvtool Engine.generate", "_int4": "kvtool int4 projections",
            "_bf16": "kvtool bf16 weights", "_fast": "kvtool fast path"}  # (_fast: the static decoder, in older records of benchmarks/results)


def variant_of(metric: str) -> tuple[str, str | None]:
    """(base metric, variant label or None for plain kvtool)."""
    for suffix, label in VARIANTS.items():
        if metric.endswith(suffix):
            return metric.removesuffix(suffix), label
    return metric, None


def weights_copy(bm, weights: str):
    """The bench model's runner rebuilt from its folder with int4 or bf16 weights, or None where that does not apply."""
    from kvtool.kernels import cpu_gemm, quant
    from kvtool.models.loading import build_runner

    runner = bm.runner
    if runner.device.type != "cpu" or runner.weights != "dense" or runner.dtype != torch.float32:
        return None
    weight = runner.output_weight
    if quant.unsupported(weight) if weights == "int4" else cpu_gemm.unsupported(weight, torch.bfloat16):
        return None
    return build_runner(runner.spec, bm.model.hf_config, bm.model.folder, runner.device, runner.dtype,
                        progress=False, weights=weights)


@torch.inference_mode()
def weights_fidelity(dense, packed, prompt: list[int], n: int, prefill: bool = False) -> dict:
    """Next-token KL(dense || copy), max |logprob diff| and top-1 agreement over n greedy decode steps of the
    dense model, the int4 or bf16 copy fed the same tokens one at a time (so every step runs its decode kernel);
    with `prefill`, also the top-1 agreement at every position of one prefill of the prompt and those tokens."""
    caches = dense.new_cache(len(prompt) + n + 1), packed.new_cache(len(prompt) + n + 1)
    p = dense.prefill(prompt, caches[0]).log_softmax(-1)
    q = packed.prefill(prompt, caches[1]).log_softmax(-1)
    kl, diff, agree, tokens = [], [], 0, []
    for _ in range(n):
        token = int(p.argmax(-1))
        tokens.append(token)
        kl.append(float((p.exp() * (p - q)).sum()))
        diff.append(float((p - q).abs().max()))
        agree += int(q.argmax(-1)) == token
        p = dense(torch.tensor([token]), caches[0]).log_softmax(-1)
        q = packed(torch.tensor([token]), caches[1]).log_softmax(-1)
    out = {"steps": n, "kl_mean": sum(kl) / n, "kl_max": max(kl), "max_abs_logprob_diff": max(diff),
           "top1_agreement": agree / n}
    if prefill:
        ids = prompt + tokens
        rows = [r.prefill(ids, r.new_cache(len(ids) + 1), logits="all").argmax(-1) for r in (dense, packed)]
        out["prefill_top1_agreement"] = float((rows[0] == rows[1]).float().mean())
    return out


def hf_generate(hf, prompt: list[int], n: int, streamer=None) -> None:
    ids = torch.tensor([prompt], device=hf.device)
    with torch.no_grad():
        hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                    do_sample=False, pad_token_id=0, streamer=streamer)


def hf_decode_rate(hf, prompt: list[int], n: int) -> float:
    """Tokens/s of the n decode steps inside one transformers generate() of n + 1 tokens: from the first
    new token to the last, as its streamer receives them (transformers reads each to the host, as a
    streaming caller would). One run, so no difference of two noisy runs that could come out negative."""
    from transformers.generation.streamers import BaseStreamer

    class Stamps(BaseStreamer):  # put() gets the prompt, then every new token
        def __init__(self):
            self.times: list[float] = []

        def put(self, value) -> None:
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    stamps = Stamps()
    hf_generate(hf, prompt, n + 1, stamps)
    if len(stamps.times) != n + 2:
        raise RuntimeError(f"transformers streamed {len(stamps.times) - 1} tokens, not {n + 1}")
    return n / (stamps.times[-1] - stamps.times[1])


def run_decode_bench(bm, cfg: DecodeBenchConfig | None = None,
                     log=lambda s: print(s, file=sys.stderr, flush=True)) -> dict:
    """Decode tok/s and cold TTFT of ``bm`` (a BenchModel), beside transformers; returns the JSON record."""
    cfg = (cfg or DecodeBenchConfig()).validate(bm.runner.spec.max_position)
    runner, device, n = bm.runner, bm.device, cfg.decode_tokens
    vocab = runner.spec.vocab_size
    lo = min(100, vocab // 4)
    gen = torch.Generator().manual_seed(cfg.seed)
    prompt = torch.randint(lo, vocab - lo, (cfg.prompt_tokens,), generator=gen).tolist()
    engines = ["kvtool"] + (["transformers"] if cfg.baseline else [])
    hf = bm.hf() if cfg.baseline else None

    log(f"decode: {n} tokens after a {len(prompt)}-token prompt ({bm.name} on {device})")
    from kvtool.engine import Engine

    engine = Engine(bm.model)  # no prefix cache: each run prefills its prompt, as kvtool_decode does
    fns = {"kvtool": lambda: kvtool_decode(runner, prompt, n),
           "transformers": lambda: hf_decode_rate(hf, prompt, n),
           "kvtool Engine.generate": lambda: engine_decode(engine, prompt, n)}
    labels = [*engines, "kvtool Engine.generate"]
    packed = weights_copy(bm, "int4") if cfg.int4 else None
    half = weights_copy(bm, "bf16") if cfg.bf16 else None
    for copy, name, what in ((packed, "int4", "projections in 4 bits"), (half, "bf16", "weights rounded to bf16")):
        if copy is not None:
            log(f"{name} copy: {what}, timed in the same runs")
            fns[f"kvtool {name}"] = lambda copy=copy: kvtool_decode(copy, prompt, n)
            labels.append(f"kvtool {name}")
    decode = measure_side_by_side({e: fns[e] for e in labels}, cfg.repeats, cfg.warmup, device)
    rows = {"decode_tok_s": {e: decode[e] for e in engines},
            "decode_tok_s_engine": {"kvtool": decode["kvtool Engine.generate"]}}
    del engine
    fidelity = {}
    if packed is not None:
        rows["decode_tok_s_int4"] = {"kvtool": decode["kvtool int4"]}
        fidelity["int4_fidelity"] = weights_fidelity(runner, packed, prompt, n, prefill=True)
        del packed
    if half is not None:
        rows["decode_tok_s_bf16"] = {"kvtool": decode["kvtool bf16"]}
        fidelity["bf16_fidelity"] = weights_fidelity(runner, half, prompt, n, prefill=True)
    for length in cfg.ttft_lengths:
        ids = torch.randint(lo, vocab - lo, (length,), generator=gen).tolist()
        log(f"cold TTFT at {length} tokens (ms)")
        fns = {"kvtool": lambda: kvtool_ttft(runner, ids, cfg.prefill_chunk),
               "transformers": lambda: hf_generate(hf, ids, 1),
               "kvtool bf16": lambda: kvtool_ttft(half, ids, cfg.prefill_chunk)}
        timed = [*engines, *(["kvtool bf16"] if half is not None else [])]
        ttft = measure_side_by_side({e: fns[e] for e in timed}, cfg.repeats, cfg.warmup, device)
        rows[f"ttft_ms_{length}"] = {e: ttft[e] for e in engines}
        if half is not None:
            rows[f"ttft_ms_{length}_bf16"] = {"kvtool": ttft["kvtool bf16"]}
    del half
    ratios, paired = {}, {}
    for metric, row in rows.items():
        base = rows[variant_of(metric)[0]]
        if "transformers" in base:
            k, t = row["kvtool"]["median"], base["transformers"]["median"]
            ratios[metric] = round(k / t if metric.startswith("decode") else t / k, 3)  # >1: kvtool is faster
            paired[metric] = paired_speedup(row["kvtool"], base["transformers"], rate=metric.startswith("decode"))
    measured = {metric: row["kvtool"]["median"] for metric, row in rows.items()
                if not metric.endswith(("_int4", "_bf16"))}
    return {"benchmark": "decode", "model": bm.name, "device": device_name(device), "device_type": device.type,
            "dtype": bm.dtype, "decode_tokens": n, "config": asdict(cfg), "results": rows,
            "speedup_vs_transformers": ratios, "paired_speedup_vs_transformers": paired,
            "target_checks": check_all(TARGETS, measured, device.type),
            **fidelity, "versions": versions()}


def paired_text(pair: dict | None) -> str:
    """A paired_speedup() summary as 'median x (min-max)'; '-' without one."""
    return f"{pair['median']:.2f}x ({pair['min']:.2f}-{pair['max']:.2f})" if pair else "-"


def format_table(record: dict) -> str:
    lines = [f"\n{record['model']} on {record['device']}, {record['dtype']}",
             f"{'metric':<18}{'kvtool':>12}{'transformers':>14}{'ratio':>8}   run by run: median (min-max)"]
    for metric, row in record["results"].items():
        t = row.get("transformers")
        ratio = record["speedup_vs_transformers"].get(metric)
        pair = record.get("paired_speedup_vs_transformers", {}).get(metric)
        lines.append(f"{metric:<18}{row['kvtool']['median']:>12.2f}"
                     + (f"{t['median']:>14.2f}" if t else f"{'-':>14}") + (f"{ratio:>7.2f}x" if ratio else f"{'-':>8}")
                     + (f"   {paired_text(pair)}" if pair else ""))
    for name in ("int4", "bf16"):
        if fid := record.get(f"{name}_fidelity"):
            lines.append(f"{name} vs dense over {fid['steps']} greedy steps: top-1 agreement "
                         f"{fid['top1_agreement']:.3f}, KL mean {fid['kl_mean']:.5f} (max {fid['kl_max']:.5f})"
                         + (f"; in one prefill {fid['prefill_top1_agreement']:.3f}" if "prefill_top1_agreement" in fid
                            else ""))
    return "\n".join(lines)


def report(record: dict, out: str | None) -> None:
    print(format_table(record))
    emit(record, out)
