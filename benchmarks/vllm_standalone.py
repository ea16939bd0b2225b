"""A plain vLLM server for the skill benchmarks, started the way a user starts it: `python -m
vllm.entrypoints.openai.api_server` with vLLM's default multiprocessing (the engine core in a process of its own),
with or without prefix caching, and kvtool's KV connector mounted by --kv-transfer-config alone. Requests are token
ids to /v1/completions; each answer comes back with its latency and, where the connector is mounted, the
connector's account of the request (kv_transfer_params["kvtool"]).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

SERVER = "python -m vllm.entrypoints.openai.api_server"
FLAGS = ["--dtype", "float32", "--enforce-eager", "--enable-prompt-tokens-details"]
MAX_LEN = 4096  # --max-model-len
# 1 GiB of KV; vLLM's default multiprocessing; its development endpoints (/reset_prefix_cache)
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_SERVER_DEV_MODE": "1"}


def describe() -> dict:
    """What the record says about the vLLM servers."""
    from kvtool.integrations.vllm.mount import CLASS_NAME, MODULE

    return {"server": SERVER, "connector": f"kv_transfer_config ({MODULE}.{CLASS_NAME})",
            "multiprocessing": "vLLM's default: the engine core in its own process", "flags": FLAGS,
            "max_model_len": MAX_LEN, "env": ENV,
            "repair": "none (the only one the connector runs)"}


def command(folder: str, port: int, prefix_caching: bool, extra: dict | None = None, python: str | None = None,
            max_len: int = MAX_LEN) -> list[str]:
    """The server's argv on the model's HF folder; `extra`: the connector's kv_connector_extra_config (None: no
    connector); `python`: the vLLM environment's interpreter (default: this one)."""
    argv = [python or sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", folder,
            "--served-model-name", "m", "--host", "127.0.0.1", "--port", str(port), *FLAGS, "--max-model-len",
            str(max_len),
            "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching"]
    if extra is not None:
        from kvtool.integrations.vllm.mount import transfer_config

        argv += ["--kv-transfer-config", json.dumps(transfer_config(extra))]
    return argv


def start(folder: str, log: Path, prefix_caching: bool, extra: dict | None = None, name: str = "vllm",
          python: str | None = None, max_len: int = MAX_LEN, kv_gib: int | None = None, threads: int | None = None):
    """command()'s server, ready (kvtool.bench.peers.servers.ServerProcess: stopped with its whole process
    group); kv_gib: its KV space (default ENV's), threads: OMP_NUM_THREADS."""
    from kvtool.bench.peers.servers import ServerProcess, free_port

    port = free_port()
    env = {**ENV, **({"VLLM_CPU_KVCACHE_SPACE": str(kv_gib)} if kv_gib else {}),
           **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    server = ServerProcess(name, command(folder, port, prefix_caching, extra, python, max_len), port, log, env=env,
                           startup_s=900.0)
    server.start()
    return server


def complete(url: str, ids: list[int], **body) -> tuple[float, dict]:
    """(latency in ms, the response) of a greedy completion of the token ids `ids` (one token unless `body` says
    otherwise), with token ids in the answer and as the keys of its logprobs ("token_id:N")."""
    import httpx

    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/completions", timeout=1800, json={
        "model": "m", "prompt": ids, "max_tokens": 1, "temperature": 0, "return_token_ids": True,
        "return_tokens_as_token_ids": True, **body})
    ms = (time.perf_counter() - t0) * 1000.0
    if r.status_code != 200:
        raise RuntimeError(f"vLLM answered {r.status_code}: {r.text[:2000]}")
    return ms, r.json()


def account(response: dict) -> dict | None:
    """The connector's account of the request (store_tokens, block_tokens, skill_path, ...), None without it."""
    return (response.get("kv_transfer_params") or {}).get("kvtool")
