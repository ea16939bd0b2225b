"""Live servers on loopback, one per real model for the whole session (the models load once)."""

from __future__ import annotations

import json

import httpx
import pytest

@pytest.fixture(scope="session")
def skill_catalog(tmp_path_factory):
    """skill_catalog(model, {file name: SKILL.md text}): those skills' catalog, compiled for model into a fresh
    cache folder."""
    from kvtool.skills import load_catalog

    def build(model, skills: dict[str, str]):
        folder = tmp_path_factory.mktemp("skills")
        for name, text in skills.items():
            (folder / name).write_text(text)
        return load_catalog(folder, model, cache_dir=tmp_path_factory.mktemp("skills-kvb"), log=lambda m: None)

    return build


def start_server(model, **config):
    from kvtool.serving import ServerConfig, create_app
    from kvtool.serving.server import BackgroundServer

    return BackgroundServer(create_app(model, server_config=ServerConfig(**config))).start()


@pytest.fixture(scope="session")
def smol_server(smollm2):
    srv = start_server(smollm2, default_max_tokens=8)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def qwen_server(qwen25):
    srv = start_server(qwen25, default_max_tokens=16)
    yield srv
    srv.stop()


@pytest.fixture
def smol(smol_server):
    with httpx.Client(base_url=smol_server.base_url, timeout=120) as client:
        yield client


@pytest.fixture
def qwen(qwen_server):
    with httpx.Client(base_url=qwen_server.base_url, timeout=300) as client:
        yield client


def _sse_events(response) -> list:
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


@pytest.fixture(scope="session")
def sse_events():
    """sse_events(response) -> the data payloads of an SSE response: parsed JSON, or '[DONE]'."""
    return _sse_events


def _vllm_server(gguf, tmp_path_factory, max_tokens: int):
    """kvtool serve --engine vllm in a child process (vLLM changes process-wide thread settings), started once
    per session; stopped with SIGINT at the end (test_vllm_start_stop checks the exit itself)."""
    from kvtool.integrations.vllm import available

    if not available():
        pytest.skip("vLLM is not installed (pip install -e '.[vllm]'; scripts/setup.sh --test installs it)")
    from kvtool.testing.server_process import ServerProcess

    log = tmp_path_factory.mktemp("vllm") / "serve.log"
    srv = ServerProcess(["--engine", "vllm", "--model", str(gguf), "--default-max-tokens", str(max_tokens),
                         "--engine-arg", "max_model_len=4096", "--log-level", "warning"], log).start()
    print(f"\nvLLM server for {gguf.name} ready in {srv.startup_s:.1f} s")
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def vllm_smol_server(tmp_path_factory):
    from kvtool.testing.models import smollm2_gguf

    yield from _vllm_server(smollm2_gguf(), tmp_path_factory, 8)


@pytest.fixture(scope="session")
def vllm_qwen_server(tmp_path_factory):
    from kvtool.testing.models import qwen25_gguf

    yield from _vllm_server(qwen25_gguf(), tmp_path_factory, 16)


@pytest.fixture(scope="session")
def vllm_gemma_server(tmp_path_factory):
    from kvtool.testing.models import gemma3_gguf

    yield from _vllm_server(gemma3_gguf(), tmp_path_factory, 8)


@pytest.fixture(scope="session")
def gemma_server(gemma3):
    srv = start_server(gemma3, default_max_tokens=8)
    yield srv
    srv.stop()
