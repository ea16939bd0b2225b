"""bs=1 decode tokens/s and cold TTFT, kvtool vs transformers `generate`, same model, same run.

    python benchmarks/decode.py                      # embedded SmolLM2 GGUF (offline)
    python benchmarks/decode.py --shape qwen3-0.6b   # random weights in the Qwen3-0.6B shape (GPU timing)
    python benchmarks/decode.py --model PATH_OR_ID --out benchmarks/results/decode-cpu.json
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import device_name, emit, measure, versions  # noqa: E402


def load_models(args, device, dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvtool.models.loading import build_runner, load
    from kvtool.models.spec import ModelSpec

    if args.shape:
        from kvtool.testing.tiny import qwen3_0_6b_config, random_checkpoint

        folder = random_checkpoint(qwen3_0_6b_config(), Path(tempfile.mkdtemp(prefix="kvtool-bench-")))
        cfg = AutoConfig.from_pretrained(str(folder))
        runner = build_runner(ModelSpec.from_hf_config(cfg), cfg, folder, device, dtype)
        name = "Qwen3-0.6B shape (random weights)"
    else:
        from kvtool.models.resolve import resolve_model_arg

        model = load(resolve_model_arg(args.model), device=str(device), dtype=str(dtype).replace("torch.", ""))
        folder, runner, name = model.folder, model.runner, model.name
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).to(device).eval()
    return name, runner, hf


def kvtool_decode(runner, prompt, n):
    """Tokens/s over n greedy decode steps after a prefill (host sync per token, as when streaming)."""
    import time

    cache = runner.new_cache(len(prompt) + n + 1)
    logits = runner.prefill(prompt, cache)
    tok = int(logits.argmax(-1))
    t0 = time.perf_counter()
    for _ in range(n):
        tok = int(runner(torch.tensor([tok], device=runner.device), cache).argmax(-1))
    return n / (time.perf_counter() - t0)


def kvtool_ttft(runner, prompt, chunk):
    cache = runner.new_cache(len(prompt) + 1)
    int(runner.prefill(prompt, cache, chunk=chunk).argmax(-1))


def hf_generate(hf, prompt, n):
    ids = torch.tensor([prompt], device=hf.device)
    with torch.no_grad():
        hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                    do_sample=False, pad_token_id=0)


def main() -> None:
    import time

    from kvtool.models.loading import pick_device, pick_dtype

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--shape", choices=["qwen3-0.6b"], default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--ttft-lengths", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None, help="also write the JSON record here")
    args = p.parse_args()

    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    name, runner, hf = load_models(args, device, dtype)
    vocab = runner.spec.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, vocab - 100, (32,), generator=gen).tolist()
    n = args.decode_tokens
    rows = {}

    print(f"decode: {n} tokens after a {len(prompt)}-token prompt", file=sys.stderr)
    rows["decode_tok_s"] = {
        "kvtool": measure(lambda: kvtool_decode(runner, prompt, n), args.repeats, device=device, label="kvtool"),
    }

    def hf_decode():
        t0 = time.perf_counter()
        hf_generate(hf, prompt, 1)
        t1 = time.perf_counter()
        hf_generate(hf, prompt, n + 1)
        t2 = time.perf_counter()
        return n / ((t2 - t1) - (t1 - t0))

    rows["decode_tok_s"]["transformers"] = measure(hf_decode, args.repeats, device=device, label="transformers")
    for length in args.ttft_lengths:
        ids = torch.randint(100, vocab - 100, (length,), generator=gen).tolist()
        print(f"cold TTFT at {length} tokens (ms)", file=sys.stderr)
        rows[f"ttft_ms_{length}"] = {
            "kvtool": measure(lambda: kvtool_ttft(runner, ids, 512), args.repeats, device=device, label="kvtool"),
            "transformers": measure(lambda: hf_generate(hf, ids, 1), args.repeats, device=device,
                                    label="transformers"),
        }

    print(f"\n{name} on {device_name(device)}, {str(dtype).replace('torch.', '')}")
    print(f"{'metric':<18}{'kvtool':>12}{'transformers':>14}{'ratio':>8}")
    ratios = {}
    for metric, row in rows.items():
        k, t = row["kvtool"]["median"], row["transformers"]["median"]
        ratio = k / t if metric.startswith("decode") else t / k  # >1 means kvtool is faster
        ratios[metric] = round(ratio, 3)
        print(f"{metric:<18}{k:>12.2f}{t:>14.2f}{ratio:>7.2f}x")
    emit({"benchmark": "decode", "model": name, "device": device_name(device), "device_type": device.type,
          "dtype": str(dtype).replace("torch.", ""), "decode_tokens": n, "results": rows,
          "speedup_vs_transformers": ratios, "versions": versions()}, args.out)


if __name__ == "__main__":
    main()
