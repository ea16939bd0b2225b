"""Live servers on loopback, one per real model for the whole session (the models load once)."""

from __future__ import annotations

import json

import httpx
import pytest

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
