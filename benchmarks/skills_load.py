"""Skills loaded as KV blocks into prompts under load: `kvtool serve` in three modes, vLLM's own `bench serve`
client sending Poisson arrivals at several request rates, and fidelity against full recompute. Run it from
kvtool's environment; the client runs in the vLLM environment:

    python benchmarks/skills_load.py --model smollm2 --vllm-python .venv-vllm/bin/python --out skills-load.json

The library is kvtool.bench.skill_library's: 16 SKILL.md-shaped skills of about 1,000-3,000 tokens after one
shared system prompt; each request loads 2-4 of them in random order and asks about one. Every prompt is rendered
with the model's chat template here and sent as text to /v1/completions (vLLM's `custom` dataset with
--skip-chat-template), so the server sees exactly the tokens the skill blocks were compiled for.

Modes, each a `kvtool serve` started fresh and warmed with --warmup requests: cold (--no-prefix-cache, no skills),
prefix (the prefix cache alone) and compose (--skills mounted, repair --repair). Per mode and rate (the prefix cache
emptied before each rate): p50/p90/p99 TTFT, request and output throughput (vLLM's result JSON), and the share of
prompt tokens the prefix cache served (the server's /metrics counters, which do not count spliced block tokens).
Then, at no load on an emptied cache, every request once with greedy 32 tokens and top-20 logprobs: the share of
prompt tokens not computed (usage: cached_tokens + skill_block_tokens over prompt_tokens) and, against cold (full
recompute), first-token agreement, mean KL over cold's top 20 (both renormalised there) and identical greedy
answers.

--engines vllm runs the same three modes on plain vLLM servers (benchmarks/skills_load_vllm.py: `python -m
vllm.entrypoints.openai.api_server` from the vLLM environment, prefix caching off / on / on with kvtool's KV
connector mounted by --kv-transfer-config and the library compiled to .kvb blocks), composition on a fresh server
for each rate since the connector's block store cannot be emptied from outside. Requests that do not fit
the model's context (with their output) are left out of the set, on both engines alike.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import emit, versions  # noqa: E402

MODES = {"cold": ["--no-prefix-cache"], "prefix": [], "compose": ["--skills", "{skills}"]}
SERVED = "skills-load"  # the model id the server answers to and the client names
PERCENTILES = ("50", "90", "99")
FIDELITY_TOKENS, TOP = 32, 20
# vLLM's CustomDataset reads its JSONL through pandas, which vLLM's CPU environment need not have (the `bench`
# extra brings it): without pandas the client reads the same file line by line, shuffled as vLLM would
JSONL_READER = """
import json, random
from vllm.benchmarks.datasets.datasets import CustomDataset
def _rows(self):
    with open(self.dataset_path, encoding="utf-8") as f:
        self.data = [json.loads(line) for line in f if line.strip()]
    random.seed(self.random_seed)
    if not getattr(self, "disable_shuffle", False):
        random.shuffle(self.data)
try:
    import pandas
except ImportError:
    CustomDataset.load_data = _rows
"""


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def render_prompts(folder: Path, skills, reqs) -> list[str]:
    """Each request's chat as the text the model's chat template makes of it, ready for generation."""
    from transformers import AutoTokenizer

    from kvtool.bench.skill_library import messages

    tok = AutoTokenizer.from_pretrained(str(folder))
    return [tok.apply_chat_template(messages(r, skills), tokenize=False, add_generation_prompt=True) for r in reqs]


def write_dataset(path: Path, prompts: list[str], output_tokens: int) -> Path:
    """vLLM bench serve's `custom` dataset: one JSON object a line with `prompt` (and `output_tokens`)."""
    path.write_text("".join(json.dumps({"prompt": p, "output_tokens": output_tokens}) + "\n" for p in prompts))
    return path


def client_args(base_url: str, folder: Path, dataset: Path, n: int, rate: float, output_tokens: int, seed: int,
                result: Path, served: str = SERVED) -> list[str]:
    """`vllm bench serve` arguments: the rendered prompts as they are, in order, Poisson arrivals at `rate`."""
    return ["--backend", "openai", "--endpoint", "/v1/completions", "--base-url", base_url, "--model", served,
            "--tokenizer", str(folder), "--dataset-name", "custom", "--dataset-path", str(dataset),
            "--custom-output-len", str(output_tokens), "--skip-chat-template", "--disable-shuffle",
            "--num-prompts", str(n), "--request-rate", str(rate), "--seed", str(seed), "--temperature", "0",
            "--ignore-eos", "--num-warmups", "0", "--disable-tqdm", "--percentile-metrics", "ttft,tpot,e2el",
            "--metric-percentiles", ",".join(PERCENTILES), "--save-result", "--result-dir", str(result.parent),
            "--result-filename", result.name]


def load_figures(data: dict) -> dict:
    """The record's figures from one `vllm bench serve` result JSON."""
    out = {k: data[k] for k in ("completed", "failed", "duration", "request_throughput", "output_throughput")
           if k in data}
    for p in PERCENTILES:
        out[f"ttft_ms_p{p}"] = round(data[f"p{p}_ttft_ms"], 1)
    return out


KVTOOL_COUNTERS = {"kvtool_prompt_tokens_total": "prompt", "kvtool_prompt_cached_tokens_total": "cached"}


def metric_totals(text: str, names: dict = KVTOOL_COUNTERS) -> dict:
    """The prompt-token counters of a /metrics exposition (`names`: counter -> key), summed over their labels."""
    out = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        name = name.partition("{")[0]
        if name in names:
            out[names[name]] = out.get(names[name], 0.0) + float(value)
    return out


def cached_share(before: dict, after: dict) -> float | None:
    """Prompt tokens the prefix cache served over all prompt tokens, between two /metrics readings."""
    prompt = after["prompt"] - before["prompt"]
    return round((after["cached"] - before["cached"]) / prompt, 4) if prompt else None


def uncomputed_share(usages: list[dict]) -> float:
    """Prompt tokens the model did not compute (prefix cache + spliced skill blocks) over all prompt tokens."""
    details = [u.get("prompt_tokens_details") or {} for u in usages]
    served = sum(d.get("cached_tokens", 0) + d.get("skill_block_tokens", 0) for d in details)
    return round(served / sum(u["prompt_tokens"] for u in usages), 4)


def top_kl(ref: dict[str, float], got: dict[str, float]) -> float:
    """KL(ref || got) over ref's top tokens, both renormalised there; a token got lacks takes got's floor."""
    floor = min(got.values())
    p = _normalised([ref[k] for k in ref])
    q = _normalised([got.get(k, floor) for k in ref])
    return sum(math.exp(a) * (a - b) for a, b in zip(p, q))


def _normalised(logprobs: list[float]) -> list[float]:
    top = max(logprobs)
    total = top + math.log(sum(math.exp(x - top) for x in logprobs))
    return [x - total for x in logprobs]


def fidelity(ref: list[dict], got: list[dict]) -> dict:
    """Against full recompute, request by request: {"text", "first", "top"} answers (first: the first token,
    top: its top logprobs by token text)."""
    n = len(ref)
    return {"first_token_agreement": round(sum(r["first"] == g["first"] for r, g in zip(ref, got)) / n, 4),
            "kl_top20_mean": round(sum(top_kl(r["top"], g["top"]) for r, g in zip(ref, got)) / n, 5),
            "greedy_identical": round(sum(r["text"] == g["text"] for r, g in zip(ref, got)) / n, 4)}


def answer(base: str, prompt: str, client, served: str = SERVED) -> tuple[dict, dict]:
    """One greedy completion with top-20 logprobs at no load: the answer and its usage."""
    r = client.post(f"{base}/v1/completions", json={"model": served, "prompt": prompt, "temperature": 0,
                                                     "max_tokens": FIDELITY_TOKENS, "logprobs": TOP})
    r.raise_for_status()
    body = r.json()
    lp = body["choices"][0]["logprobs"]
    return ({"text": body["choices"][0]["text"], "first": lp["tokens"][0], "top": lp["top_logprobs"][0]},
            body["usage"])


def reset_cache(base: str, client, mode: str) -> None:
    if mode != "cold":  # cold serves no prefix cache to empty
        client.post(f"{base}/v1/cache/reset").raise_for_status()


def loaded_rate(base: str, client, label: str, rate: float, args, files, dataset: Path, n: int, work: Path,
                served: str = SERVED, counters: dict = KVTOOL_COUNTERS) -> dict:
    """vLLM's client against the server at `base` at one rate: the result's figures and the share of prompt tokens
    the server's counters say its prefix cache served."""
    from kvtool.bench.peers.vllm_client import LAUNCH, client_python

    before = metric_totals(client.get(f"{base}/metrics").text, counters)
    result = work / "vllm-bench" / f"{label}-{rate}.json"
    result.parent.mkdir(parents=True, exist_ok=True)
    cmd = client_args(base, files.folder, dataset, n, rate, args.output_tokens, args.seed, result, served)
    t0 = time.perf_counter()
    proc = subprocess.run([client_python(args.vllm_python), "-c", JSONL_READER + LAUNCH, *cmd], capture_output=True,
                          text=True, timeout=7200)
    (work / "logs" / f"vllm-bench-{label}-{rate}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0 or not result.exists():
        raise RuntimeError(f"vLLM bench serve exited with {proc.returncode}:\n{proc.stderr[-2000:]}")
    row = load_figures(json.loads(result.read_text()))
    row["prefix_cached_share"] = cached_share(before, metric_totals(client.get(f"{base}/metrics").text, counters))
    log(f"  {label} @ {rate}/s: TTFT p50 {row['ttft_ms_p50']} p90 {row['ttft_ms_p90']} p99 {row['ttft_ms_p99']} ms, "
        f"{row['completed']} done in {time.perf_counter() - t0:.0f} s")
    return row


def run_mode(mode: str, args, files, skills_dir: Path, dataset: Path, prompts: list[str], work: Path) -> dict:
    """One fresh server in `mode`: vLLM's client at every rate, then the no-load pass."""
    import httpx

    from kvtool.bench.peers.servers import ServerProcess, free_port

    port = free_port()
    argv = [sys.executable, "-m", "kvtool.cli", "serve", "--model", str(files.folder), "--host", "127.0.0.1",
            "--port", str(port), "--served-model-name", SERVED, "--max-queue", str(len(prompts)),
            "--log-level", "warning", *(a.format(skills=skills_dir) for a in MODES[mode])]
    if mode == "compose" and args.repair:
        argv += ["--skill-repair", args.repair]
    env = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else None
    out: dict = {"rates": {}}
    with ServerProcess(f"kvtool {mode}", argv, port, work / "logs" / f"{mode}.log", env=env, startup_s=1800,
                       log_fn=log) as base, httpx.Client(timeout=1800) as client:
        for prompt in args.warmup_prompts:  # a server's first requests pay one-time costs (loads, kernel builds)
            client.post(f"{base}/v1/completions", json={"model": SERVED, "prompt": prompt, "max_tokens": 1,
                                                        "temperature": 0}).raise_for_status()
        for rate in args.rates:
            reset_cache(base, client, mode)
            out["rates"][str(rate)] = loaded_rate(base, client, f"kvtool-{mode}", rate, args, files, dataset,
                                                  len(prompts), work)
        reset_cache(base, client, mode)
        answers, usages = zip(*(answer(base, p, client) for p in prompts))
    out["uncomputed_share"] = uncomputed_share(list(usages))
    out["answers"] = list(answers)
    log(f"  {mode}: {out['uncomputed_share']:.1%} of prompt tokens not computed (no load)")
    return out


def plot(path: str, title: str, engines: dict) -> None:
    """p90 TTFT against request rate, one line per engine and mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    for (engine, row), style in zip(engines.items(), ("o-", "s--")):
        for mode, cell in row["modes"].items():
            pts = sorted((float(r), v["ttft_ms_p90"]) for r, v in cell["rates"].items())
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=f"{engine} ({mode})")
    ax.set(xlabel="request rate (requests/s, Poisson)", ylabel="p90 TTFT (ms)", title=title, yscale="log")
    ax.grid(alpha=0.3)
    ax.legend()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def fitting(folder: Path, skills, n: int, seed: int, most: int, output_tokens: int) -> tuple[list[str], int]:
    """The first n requests (of the library's request stream) whose prompt and output fit the model's context:
    (their rendered prompts, the context length)."""
    from transformers import AutoTokenizer

    from kvtool.bench.skill_library import requests

    context = json.loads((folder / "config.json").read_text())["max_position_embeddings"]
    tok = AutoTokenizer.from_pretrained(str(folder))
    reqs = requests(skills, 4 * n, seed, most=most)
    prompts = render_prompts(folder, skills, reqs)
    keep = [i for i, text in enumerate(prompts)
            if len(tok(text, add_special_tokens=False).input_ids) + output_tokens <= context][:n]
    if len(keep) < n:
        raise SystemExit(f"only {len(keep)} of {4 * n} requests fit the model's {context}-token context")
    return [prompts[i] for i in keep], context


def summarise(modes: dict) -> dict:
    """One engine's modes, fidelity against its cold mode (full recompute), composed p90 over cold and over prefix."""
    ref = modes.get("cold", {}).get("answers")
    for name, row in modes.items():
        answers = row.pop("answers")
        if ref is not None and name != "cold":
            row["fidelity"] = fidelity(ref, answers)
    out = {"modes": modes}
    for base in ("cold", "prefix"):
        if base in modes and "compose" in modes:
            out[f"p90_speedup_compose_vs_{base}"] = {
                r: round(modes[base]["rates"][r]["ttft_ms_p90"] / modes["compose"]["rates"][r]["ttft_ms_p90"], 2)
                for r in modes["compose"]["rates"]}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "qwen25"])
    ap.add_argument("--engines", nargs="+", default=["kvtool"], choices=["kvtool", "vllm"])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--rates", type=float, nargs="+", default=[0.05, 0.1, 0.2], help="requests/s (Poisson)")
    ap.add_argument("--repair", help="the composition server's --skill-repair (default: the server's default)")
    ap.add_argument("--skills", type=int, default=16, help="the library's N shortest skills (of 16)")
    ap.add_argument("--most-skills", type=int, default=4, help="most skills a request loads (at least 2)")
    ap.add_argument("--output-tokens", type=int, default=32, help="tokens each loaded request generates")
    ap.add_argument("--warmup", type=int, default=1, help="requests (beyond the measured ones) each server answers "
                    "before the first rate (then its cache is emptied)")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--threads", type=int, help="OMP_NUM_THREADS of each server")
    ap.add_argument("--vllm-kv-gib", type=int, default=4, help="each vLLM server's KV space (GiB)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vllm-python", help="the python of the vLLM environment (default: $KVTOOL_VLLM_PYTHON)")
    ap.add_argument("--plot", help="PNG of p90 TTFT against request rate")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    from kvtool.bench.peers.harness import model_files
    from kvtool.bench.skill_library import library, write_library

    record = {"benchmark": "skills_load", "config": dict(vars(args)), "loadavg_start": os.getloadavg(),
              "versions": versions()}
    files = model_files(args.model, log)
    skills = library(args.seed)[:args.skills]  # sizes grow along the library: its first skills are the shortest
    prompts, context = fitting(files.folder, skills, args.requests + args.warmup, args.seed, args.most_skills,
                               args.output_tokens)
    prompts, args.warmup_prompts = prompts[:args.requests], prompts[args.requests:]  # warm-ups outside the set
    record["context"] = context
    engines = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        write_library(work / "skills", skills)
        dataset = write_dataset(work / "prompts.jsonl", prompts, args.output_tokens)
        log(f"{args.model}: {len(skills)} skills, {len(prompts)} requests of {min(map(len, prompts))}-"
            f"{max(map(len, prompts))} characters, rates {args.rates}")
        if "kvtool" in args.engines:
            engines["kvtool"] = summarise({m: run_mode(m, args, files, work / "skills", dataset, prompts, work)
                                           for m in args.modes})
        if "vllm" in args.engines:
            from skills_load_vllm import describe, vllm_modes

            engines["vllm"] = summarise(vllm_modes(args, files, work / "skills", dataset, prompts, context, work))
            engines["vllm"]["servers"] = describe(context)
    record["engines"] = engines
    if args.plot:
        plot(args.plot, f"skills under load, {args.model}", engines)
    record["loadavg_end"] = os.getloadavg()
    emit(record, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
