"""kvtool's KV connector inside a plain vLLM server (real SmolLM2 and Qwen2.5): `python -m
vllm.entrypoints.openai.api_server` with vLLM's default multiprocessing (its engine core in a process of its own)
and the connector (kvtool.integrations.vllm.connector) given by --kv-transfer-config alone. For each model, in one
run:
- a prompt holding two mounted skills is composed: the connector's block tokens are above zero (in the response's
  kv_transfer_params and in Prometheus) and the first token equals kvtool's composed answer on the same blocks;
- the server's memory (its whole process tree) is at most 1.10x that of the same server without the connector;
- a second server on the same block store answers a long prompt the first one saw with cached_tokens >= 90%, its
  loader thread writing the stored run while the request waits in vLLM's WAITING_FOR_REMOTE_KVS (`load: async`;
  on Qwen2.5 that server runs tensor_parallel_size=2, each rank reading its KV heads out of the first one's
  records; SmolLM2's 9 attention heads do not split over 2 ranks);
- killing the first server (-9) while its writer saves leaves the store whole and readable by the second.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from kvtool.integrations.vllm import available

pytestmark = [pytest.mark.real_model, pytest.mark.slow,
              pytest.mark.skipif(not available(), reason="vLLM is not installed (pip install -e '.[vllm]')")]

STEPS = "\n".join(f"{i}. Check field {i} of the order: code OR-{i * 37 % 1000:03d}, limit {i * 13} units, "
                  f"owner team-{i % 5}." for i in range(1, 15))
SKILLS = {
    "order-audit": ("Audit an order.", "# Order audit\nFollow every step in order; report the first failing code.\n"
                    + STEPS),
    "refund-policy": ("Decide a refund.", "# Refund policy\n| tier | days | cap |\n|---|---|---|\n"
                      + "\n".join(f"| T{i} | {i * 7} | {i * 120} EUR |" for i in range(1, 16))),
}
SYSTEM = {"role": "system", "content": "You are the operations assistant. Follow the loaded skills exactly."}
LONG = " ".join(f"Ledger {i}: the depot at km {i * 4} shipped {i * 11} crates on day {i % 28}." for i in range(80))
LATER = " ".join(f"Log {i}: the ferry from pier {i} carried {i * 5} cars in shift {i % 3}." for i in range(120))


def skills_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "skills"
    folder.mkdir()
    for name, (description, body) in SKILLS.items():
        (folder / f"{name}.md").write_text(f"---\nname: {name}\ndescription: {description}\n---\n{body}\n")
    return folder


class VllmServer:
    """`python -m vllm.entrypoints.openai.api_server` in a process group of its own, as a user starts it."""

    def __init__(self, folder: str, log: Path, extra: dict | None = None, tp: int = 1):
        from kvtool.testing.server_process import free_port

        self.port = free_port()
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", folder, "--served-model-name",
                "m", "--port", str(self.port), "--dtype", "float32", "--enforce-eager", "--max-model-len", "4096",
                "--enable-prefix-caching", "--enable-prompt-tokens-details"]
        if extra is not None:
            from kvtool.integrations.vllm.mount import transfer_config

            argv += ["--kv-transfer-config", json.dumps(transfer_config(extra))]
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # vLLM's default: the engine core in its own process
        if tp > 1:  # vLLM-CPU binds each rank's threads to a NUMA node unless given cores: one share per rank
            cores = sorted(os.sched_getaffinity(0))
            per = max(1, len(cores) // tp)
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
                ",".join(map(str, cores[r * per:(r + 1) * per] or cores[r % len(cores):][:1])) for r in range(tp))
            argv += ["--tensor-parallel-size", str(tp)]
        self.log = log
        self.proc = subprocess.Popen(argv, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait(self, timeout: float = 900.0) -> "VllmServer":
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            assert self.proc.poll() is None, self.log.read_text()[-4000:]
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(2)
        raise AssertionError(f"vLLM did not start in {timeout} s: {self.log.read_text()[-4000:]}")

    def rss(self) -> int:
        import psutil

        root = psutil.Process(self.proc.pid)
        return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])

    def complete(self, prompt, **body) -> dict:
        r = httpx.post(self.url + "/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 1,
                                                             "temperature": 0, "logprobs": 1, **body}, timeout=900)
        assert r.status_code == 200, r.text
        return r.json()

    def stop(self, sig=signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=60)


def kvtool_reference(gguf, skills: Path, tmp_path: Path) -> tuple[list[int], list[int], str, list[str]]:
    """(ids of a prompt loading one skill, ids of one loading both, kvtool's composed first token, the .kvb files)
    from kvtool's own engine with the same compiled blocks."""
    from kvtool.testing.server_process import ServerProcess

    srv = ServerProcess(["--model", str(gguf), "--skills", str(skills), "--skill-repair", "none", "--skill-preamble",
                         "conversation", "--log-level", "warning"], tmp_path / "kvtool.log").start()
    try:
        with httpx.Client(base_url=srv.base_url, timeout=900) as client:
            files = [row["file"] for row in client.get("/v1/skills").json()["data"]]

            def ids(names):  # the question, then the skills loaded (the skills field appends them)
                question = {"role": "user", "content": "Which code does step 3 of the order audit check?"}
                rendered = client.post("/v1/chat/template", json={"messages": [SYSTEM, question], "skills": names})
                assert rendered.status_code == 200, rendered.text
                return rendered.json()["token_ids"]

            one, both = ids(["refund-policy"]), ids(["order-audit", "refund-policy"])
            out = client.post("/v1/completions", json={"prompt": both, "max_tokens": 1, "temperature": 0,
                                                      "logprobs": 1}).json()
            assert out["timings"]["skill_path"] == "composed", out["timings"]
            return one, both, out["choices"][0]["text"], files
    finally:
        srv.stop()


@pytest.mark.parametrize("model", ["smollm2", "qwen25"])
def test_the_connector_in_a_plain_vllm_server(model, tmp_path):
    from kvtool.cache.kvstore import open_store
    from kvtool.integrations.vllm.attach import settle
    from kvtool.models.loading import resolve_folder
    from kvtool.testing.models import qwen25_gguf, smollm2_gguf

    gguf = smollm2_gguf() if model == "smollm2" else qwen25_gguf()
    folder = str(resolve_folder(str(gguf))[0])
    one, both, kvtool_token, files = kvtool_reference(gguf, skills_dir(tmp_path), tmp_path)
    location = str(tmp_path / "store")
    extra = {"blocks": files, "kv_store": location}
    plain, first = VllmServer(folder, tmp_path / "plain.log"), VllmServer(folder, tmp_path / "first.log", extra)
    second = None
    try:
        plain.wait(), first.wait()
        for srv in (plain, first):
            learned = srv.complete(one)  # prefilled; the connector saves the prefix's tail before the skill
            composed = srv.complete(both)
        assert learned["kv_transfer_params"]["kvtool"]["skill_path"] == "prefilled", learned
        kvtool = composed["kv_transfer_params"]["kvtool"]
        assert kvtool["skill_path"] == "composed" and kvtool["block_tokens"] > 0, kvtool
        assert composed["choices"][0]["text"] == kvtool_token, (composed["choices"][0], kvtool_token)
        cached = composed["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= kvtool["block_tokens"] + kvtool["store_tokens"], composed["usage"]
        metrics = httpx.get(first.url + "/metrics").text
        counted = [line for line in metrics.splitlines() if line.startswith("vllm:kvtool_block_tokens_total")]
        assert counted and float(counted[0].split()[-1]) == kvtool["block_tokens"], counted
        with_connector, without = first.rss(), plain.rss()
        print(json.dumps({"model": model, "rss_with_connector": with_connector, "rss_without": without,
                          "composed": kvtool, "usage": composed["usage"]}))
        assert with_connector <= 1.10 * without, (with_connector, without)
        plain.stop()

        long = first.complete(LONG)
        store = open_store(location)
        settle(store, quiet_s=1.0, limit_s=120.0)
        second = VllmServer(folder, tmp_path / "second.log", {**extra, "load": "async"},
                            tp=2 if model == "qwen25" else 1).wait()  # its loader thread writes what it reads
        again = second.complete(LONG)["usage"]
        print(json.dumps({"model": model, "second_server_long_prompt": again}))
        assert again["prompt_tokens_details"]["cached_tokens"] >= 0.9 * again["prompt_tokens"], (again, long["usage"])

        before = store.usage()["blocks"]
        sender = threading.Thread(target=lambda: first_later(first), daemon=True)
        sender.start()
        end = time.monotonic() + 600
        while store.usage()["blocks"] == before and time.monotonic() < end:  # its writer has begun the save
            time.sleep(0.01)
        first.stop(signal.SIGKILL)
        assert store.usage()["blocks"] > before
        store.check_integrity()
        info = subprocess.run([sys.executable, "-m", "kvtool.cli", "cache", "info", location], capture_output=True,
                              text=True, timeout=300)
        assert info.returncode == 0, info.stderr
        second.complete(LATER)  # whatever the killed server stored, the other one reads
        assert second.complete(LONG)["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0.9 * again["prompt_tokens"]
    finally:
        for srv in (plain, first, second):
            if srv is not None:
                srv.stop(signal.SIGKILL)


def first_later(srv: VllmServer) -> None:
    try:
        srv.complete(LATER)
    except (httpx.HTTPError, AssertionError):
        pass  # the server was killed while it saved, as intended
