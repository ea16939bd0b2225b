"""kvtool serve --engine vllm --cache-file: a file saved for another model is refused at start with a clear
error naming the difference, and killing the server while it saves leaves the last good file (real SmolLM2 and
Qwen2.5; the file goes through kvtool's KV connector)."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from kvtool.engines.vllm import available

pytestmark = [pytest.mark.real_model,
              pytest.mark.skipif(not available(), reason="vLLM is not installed (pip install -e '.[vllm]')")]

LONG = " ".join(f"Entry {i}: the lighthouse at cape {i} logs {i * 3} ships a night." for i in range(60))


def smol_file(model, path):
    """A real .kvc for `model`: the KV of 64 prompt tokens, saved as kvtool's engine saves its prefix cache."""
    from kvtool.cache.manager import PrefixCache

    ids = model.encode(LONG)[:64]
    cache = model.runner.new_cache(80)
    model.runner.prefill(ids, cache, logits="none")
    store = PrefixCache.for_runner(model.runner, 1 << 26)
    store.import_chain(ids, lambda i: cache.stacked(i * 16, (i + 1) * 16))
    store.save(path, model)
    return path


def test_a_file_for_another_model_is_refused_naming_the_difference(smollm2, tmp_path):
    from kvtool.testing.models import qwen25_gguf

    path = smol_file(smollm2, tmp_path / "smol.kvc")
    done = subprocess.run([sys.executable, "-m", "kvtool.cli", "serve", "--engine", "vllm", "--model",
                           str(qwen25_gguf()), "--cache-file", str(path), "--port", "0"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode != 0, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("kvtool: error:")]
    assert len(errors) == 1, done.stderr[-3000:]
    assert "different setup" in errors[0] and "model:" in errors[0] and "SmolLM2" in errors[0], errors[0]
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("model", ["smollm2"])  # Qwen2.5 beside the rest of the vLLM suite ran out of 24 GB
def test_killing_the_server_during_a_save_leaves_the_last_good_file(model, tmp_path):
    from kvtool.cache.persist import describe_file
    from kvtool.testing.models import qwen25_gguf, smollm2_gguf
    from kvtool.testing.server_process import ServerProcess

    path = tmp_path / "prefix.kvc"
    gguf = smollm2_gguf() if model == "smollm2" else qwen25_gguf()
    srv = ServerProcess(["--engine", "vllm", "--model", str(gguf), "--cache-file", str(path),
                         "--engine-arg", "max_model_len=4096", "--log-level", "warning"], tmp_path / "serve.log").start()
    try:
        with httpx.Client(base_url=srv.base_url, timeout=600) as client:
            first = client.post("/v1/completions", json={"prompt": LONG, "max_tokens": 1}).json()
            saved = client.post("/v1/cache/save").json()
            assert saved["tokens"] > 0 and saved["tokens"] >= first["usage"]["prompt_tokens"] - 16, saved
            for i in range(3):  # more prefixes: the next save writes a bigger file
                client.post("/v1/completions", json={"prompt": f"Variant {i}. " + LONG, "max_tokens": 1})

            def save():
                try:
                    client.post("/v1/cache/save")
                except httpx.HTTPError:
                    pass  # the server died mid-save, as intended

            saver = threading.Thread(target=save)
            saver.start()
            time.sleep(0.05)
            srv.stop(signal.SIGKILL)
            saver.join(timeout=60)
    finally:
        srv.stop(signal.SIGKILL)
    info = describe_file(path)  # verified: checksum, setup, index
    assert info["tokens"] >= saved["tokens"], info
    assert info["setup"]["model"] == saved.get("model", info["setup"]["model"])
