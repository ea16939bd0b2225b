"""vLLM's own benchmark client (`vllm bench serve`) as `kvtool bench peers` workloads (vllm-bench, serve-long,
serve-shared; config.ClientLoad sizes each): the same random prompts, with one shared prefix where the load has
one (its `random` dataset with --random-prefix-len, seeded), sent to every engine's OpenAI completions route, its
JSON result (--save-result) folded into the record under the workload's key (result_key). A reader with vLLM
installed can rerun the exact command the record keeps.

The client runs in the vLLM environment (--vllm-python) through the module vLLM's CLI itself calls
(vllm.benchmarks.serve: add_cli_args, main), so it needs neither the `vllm` console script nor a GPU.
"""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

# vllm/entrypoints/cli/benchmark/serve.py does the same: the parser of `vllm bench serve`, then main(args)
LAUNCH = ("from vllm.benchmarks.serve import add_cli_args, main; "
          "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
          "p = FlexibleArgumentParser(prog='vllm bench serve'); add_cli_args(p); main(p.parse_args())")
# the figures of the result JSON the record keeps (per-request lists and texts stay in the saved file)
KEEP = ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens", "request_throughput",
        "output_throughput", "total_token_throughput", "max_concurrency")
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
PERCENTILES = ("50", "90", "99")
_PYTHONS: dict[str | None, str] = {}


def client_python(option: str | None) -> str:
    """The vLLM python (engines.vllm_python), probed once per process."""
    from kvtool.bench.peers.engines import vllm_python

    if option not in _PYTHONS:
        _PYTHONS[option] = vllm_python(option)
    return _PYTHONS[option]


def result_key(workload: str) -> str:
    """Where the record keeps a client workload's figures: vllm-bench -> vllm_bench (and vllm_bench_command)."""
    return workload.replace("-", "_")


def client_args(cfg, workload: str, base_url: str, model: str, tokenizer: str, result: Path) -> list[str]:
    """`vllm bench serve` arguments for one engine and workload (cfg.client_load sizes it): greedy, ignore_eos, a
    fixed seed, so every engine gets the same prompts and the same number of tokens to generate."""
    load = cfg.client_load(workload)
    return ["--backend", "openai", "--endpoint", "/v1/completions", "--base-url", base_url, "--model", model,
            "--tokenizer", tokenizer, "--dataset-name", "random", "--num-prompts", str(load.prompts),
            "--random-prefix-len", str(load.prefix_tokens), "--random-input-len", str(load.input_tokens),
            "--random-output-len", str(load.output_tokens), "--random-range-ratio", "0",
            "--max-concurrency", str(load.concurrency), "--request-rate", "inf", "--seed", str(cfg.seed),
            "--temperature", "0", "--ignore-eos", "--num-warmups", str(cfg.warmup), "--disable-tqdm",
            "--percentile-metrics", ",".join(PERCENTILE_METRICS), "--metric-percentiles", ",".join(PERCENTILES),
            "--save-result", "--result-dir", str(result.parent), "--result-filename", result.name]


def parse_result(data: dict) -> dict:
    """The record's figures from a `vllm bench serve` result JSON: throughput, and the mean, median and
    percentiles of TTFT, TPOT, ITL and end-to-end latency (ms)."""
    out = {k: data[k] for k in KEEP if k in data}
    for metric in PERCENTILE_METRICS:
        for stat in ("mean", "median", *(f"p{p}" for p in PERCENTILES)):
            key = f"{stat}_{metric}_ms"
            if key in data:
                out[key] = data[key]
    if "completed" not in out or "output_throughput" not in out:
        raise ValueError(f"not a `vllm bench serve` result: no completed/output_throughput in {sorted(data)[:12]}")
    out["errors"] = sum(1 for e in data.get("errors") or [] if e)
    return out


def run_client(ep, cfg, workload: str, log, timeout_s: float = 3600.0) -> dict:
    """Run vLLM's client against ep once on one workload; its figures, the result file and the command that
    reproduces them."""
    if ep.folder is None or ep.out_dir is None:
        raise RuntimeError("vLLM's client needs the model's tokenizer folder and a folder for its result")
    python, load, key = client_python(cfg.vllm_python), cfg.client_load(workload), result_key(workload)
    result = Path(ep.out_dir) / workload / f"{ep.label}.json"
    result.parent.mkdir(parents=True, exist_ok=True)
    result.unlink(missing_ok=True)
    log_file = Path(ep.out_dir) / "logs" / f"{workload}-{ep.label}.log"
    log_file.parent.mkdir(parents=True, exist_ok=True)
    args = client_args(cfg, workload, ep.base, ep.model, str(ep.folder), result)
    log(f"  vLLM bench serve ({workload}): {load.prompts} prompts ({load.prefix_tokens} shared + {load.input_tokens}"
        f" random tokens, {load.output_tokens} out), concurrency {load.concurrency}")
    proc = subprocess.run([python, "-c", LAUNCH, *args], capture_output=True, text=True, timeout=timeout_s)
    log_file.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0 or not result.exists():
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-12:])
        raise RuntimeError(f"vLLM bench serve exited with status {proc.returncode}:\n{tail}")
    out = parse_result(json.loads(result.read_text()))
    if out["completed"] < load.prompts:
        raise RuntimeError(f"vLLM bench serve completed {out['completed']} of {load.prompts} requests; "
                           f"see {log_file}")
    log(f"    {out['output_throughput']:.1f} output tok/s, TTFT median {out['median_ttft_ms']:.0f} ms, "
        f"TPOT median {out['median_tpot_ms']:.1f} ms")
    return {key: out, f"{key}_file": str(result), f"{key}_command": "vllm bench serve " + shlex.join(args)}


def workload(name: str):
    """The workload function (workloads.WORKLOADS) that runs one client load; the prompts come from vLLM's seeded
    dataset, not from the harness's token source."""
    return lambda ep, cfg, prompts, log: run_client(ep, cfg, name, log)
