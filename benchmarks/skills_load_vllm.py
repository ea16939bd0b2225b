"""benchmarks/skills_load.py's three modes on plain vLLM servers, as a user runs them: `python -m
vllm.entrypoints.openai.api_server` from the vLLM environment with vLLM's default multiprocessing
(benchmarks/vllm_standalone.py): cold (prefix caching off), prefix (prefix caching on) and compose (prefix caching
and kvtool's KV connector, mounted by --kv-transfer-config alone, with the library compiled to .kvb blocks by
`kvtool skill compile` and a block store of the server's own).

vLLM's prefix cache is emptied before each rate and the no-load pass (vLLM's development endpoint
/reset_prefix_cache), but the connector's store cannot be from outside, so composition gets a fresh server for every
rate and for the no-load pass, and cold and prefix one server each. Each server is warmed with the --warmup requests
kvtool's servers answer (requests outside the measured set); the connector's store keeps what the warm-ups saved,
the shared system prompt's blocks among them, once its writer has published them (the connector needs KV for the
text before a prompt's first skill to place the blocks).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from skills_load import answer, loaded_rate, log, uncomputed_share

SERVED = "m"  # vllm_standalone's --served-model-name
# prompt tokens, and those not computed: vLLM's prefix cache's and the connector's together
COUNTERS = {"vllm:prompt_tokens_total": "prompt", "vllm:prompt_tokens_cached_total": "cached"}


def compile_blocks(folder: Path, skills_dir: Path, out: Path) -> Path:
    """The library's skills as .kvb blocks in `out`, compiled on the model the servers serve (fp32, kvtool's default
    preamble: the blocks kvtool's own composition server builds)."""
    run = subprocess.run([sys.executable, "-m", "kvtool.cli", "skill", "compile", str(skills_dir), "-o", str(out),
                          "--model", str(folder)], capture_output=True, text=True, timeout=7200)
    if run.returncode != 0:
        raise RuntimeError(f"kvtool skill compile exited with {run.returncode}:\n{run.stderr[-2000:]}")
    if not list(out.glob("*.kvb")):
        raise RuntimeError(f"kvtool skill compile wrote no .kvb file to {out}:\n{run.stderr[-2000:]}")
    return out


def vllm_modes(args, files, skills_dir: Path, dataset: Path, prompts: list[str], context: int, work: Path) -> dict:
    """{mode: {"rates": {rate: figures}, "uncomputed_share", "answers"}} for each of args.modes."""
    import httpx

    from vllm_standalone import start

    from kvtool.cache.kvstore import open_store
    from kvtool.integrations.vllm.attach import settle

    blocks = compile_blocks(files.folder, skills_dir, work / "kvb") if "compose" in args.modes else None
    out: dict = {}
    for mode in args.modes:
        row: dict = {"rates": {}}
        passes = [*args.rates, None]  # None: the no-load pass; only the connector's store needs a server of its own
        for group in [[r] for r in passes] if mode == "compose" else [passes]:
            label = f"vllm-{mode}-{'-'.join('answers' if r is None else str(r) for r in group)}"
            extra = {"blocks": str(blocks), "kv_store": str(work / label / "store")} if mode == "compose" else None
            server = start(str(files.folder), work / "logs" / f"{label}.log", mode != "cold", extra, name=label,
                           python=args.vllm_python, max_len=context, kv_gib=args.vllm_kv_gib, threads=args.threads)
            try:
                with httpx.Client(timeout=1800) as client:
                    for prompt in args.warmup_prompts:  # the first requests pay one-time costs
                        client.post(f"{server.url}/v1/completions", json={
                            "model": SERVED, "prompt": prompt, "max_tokens": 1, "temperature": 0}).raise_for_status()
                    if extra is not None:  # the connector's writer publishes the warm-ups' blocks in the background
                        settle(open_store(extra["kv_store"]), quiet_s=1.0, limit_s=120.0)
                    for rate in group:
                        client.post(f"{server.url}/reset_prefix_cache").raise_for_status()  # (the store keeps its own)
                        if rate is not None:
                            row["rates"][str(rate)] = loaded_rate(server.url, client, f"vllm-{mode}", rate, args,
                                                                  files, dataset, len(prompts), work, SERVED, COUNTERS)
                        else:  # usage's cached_tokens: vLLM's prefix cache's tokens and the connector's together
                            answers, usages = zip(*(answer(server.url, p, client, SERVED) for p in prompts))
                            row["uncomputed_share"] = uncomputed_share(list(usages))
                            row["answers"] = list(answers)
            finally:
                server.stop()
        log(f"  vllm {mode}: {row['uncomputed_share']:.1%} of prompt tokens not computed (no load)")
        out[mode] = row
    return out


def describe(context: int) -> dict:
    """What the record says about the vLLM servers (--max-model-len: the model's context)."""
    from vllm_standalone import describe as servers

    return {**servers(), "max_model_len": context,
            "per_rate": "composition: a fresh server for each rate and one for the no-load pass; cold and prefix: "
                        "one server each, its prefix cache reset before each",
            "blocks": "kvtool skill compile of the library (kvtool's default preamble)"}
