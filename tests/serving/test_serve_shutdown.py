"""kvtool serve stops on time: SIGTERM with streams in flight drains (new requests 503), ends what still runs
after --shutdown-timeout with finish_reason "abort" and an error event, saves the cache file and exits with
no child left; a second signal exits at once."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

TIMEOUT_S = 3.0
LONG = {"prompt": "Count from one to a thousand: one, two,", "max_tokens": 4000, "ignore_eos": True, "stream": True}


def stream_events(base_url: str, body: dict, started: threading.Event, out: list) -> None:
    """Read one SSE stream to its end into out (parsed events, or the exception that broke it)."""
    try:
        with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    data = line[6:]
                    out.append(data if data == "[DONE]" else json.loads(data))
                    started.set()
    except Exception as exc:  # a dropped connection: the test reports it
        out.append(exc)
        started.set()


def start_streams(base_url: str, n: int, body: dict) -> list[tuple[threading.Thread, list]]:
    streams = []
    for _ in range(n):
        started, out = threading.Event(), []
        thread = threading.Thread(target=stream_events, args=(base_url, body, started, out), daemon=True)
        thread.start()
        streams.append((thread, out, started))
    for _, _, started in streams:
        assert started.wait(120), "a stream sent nothing"
    return [(thread, out) for thread, out, _ in streams]


def assert_each_ended_with_abort(streams: list[tuple[threading.Thread, list]]) -> None:
    """Every stream got chunks, a last one with finish_reason "abort" and one shutting_down error event."""
    for thread, events in streams:
        thread.join(10)
        assert not any(isinstance(e, Exception) for e in events), f"a stream was dropped: {events[-3:]}"
        chunks = [e for e in events if isinstance(e, dict) and e.get("choices")]
        assert len(chunks) > 1 and chunks[-1]["choices"][0]["finish_reason"] == "abort"
        error = [e for e in events if isinstance(e, dict) and "error" in e]
        assert len(error) == 1 and error[0]["error"]["code"] == "shutting_down", events[-3:]
        assert "--shutdown-timeout" in error[0]["error"]["message"]


def serve(tmp_path, *extra: str):
    from kvtool.testing.models import smollm2_gguf
    from kvtool.testing.server_process import ServerProcess

    return ServerProcess(["--model", str(smollm2_gguf()), "--shutdown-timeout", str(TIMEOUT_S), "--max-active", "8",
                          *extra], tmp_path / "serve.log").start()


def test_sigterm_with_8_streams_ends_each_with_abort_saves_and_exits_in_time(tmp_path):
    from kvtool.cache.persist import describe_file
    from kvtool.testing.server_process import children

    cache_file = tmp_path / "prefix.kvc"
    srv = serve(tmp_path, "--cache-file", str(cache_file))
    short = httpx.post(srv.base_url + "/v1/completions", json={"prompt": "The quick brown fox jumps over the lazy dog. " * 4, "max_tokens": 2},
                       timeout=120)
    assert short.status_code == 200
    streams = start_streams(srv.base_url, 8, LONG)
    kids = children(srv.proc.pid)
    sent = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    # draining: new requests are refused with 503 and Retry-After, /health says so
    deadline = time.monotonic() + 5
    while (health := httpx.get(srv.base_url + "/health", timeout=10)).status_code == 200:
        assert time.monotonic() < deadline, "the server never started draining"
        time.sleep(0.05)
    assert health.json()["status"] == "draining"
    refused = httpx.post(srv.base_url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=10)
    assert refused.status_code == 503 and refused.headers["retry-after"]
    assert refused.json()["error"]["code"] == "shutting_down"
    code = srv.proc.wait(60)
    took = time.monotonic() - sent
    assert_each_ended_with_abort(streams)
    log = srv.log
    assert code == -signal.SIGTERM, f"exit code {code}:\n{log[-2000:]}"
    assert "ended 8 requests still running" in log, log[-2000:]
    saved = describe_file(cache_file)
    assert saved["tokens"] > 0
    # the drain ends at TIMEOUT_S (+ the final chunks' settling time); the save and the exit follow
    save_s = 10.0
    assert took < TIMEOUT_S + 2.0 + save_s, f"exit took {took:.1f} s:\n{log[-2000:]}"
    time.sleep(0.5)
    assert [pid for pid in kids if os.path.exists(f"/proc/{pid}")] == [], "child processes outlived the server"
    assert "Traceback" not in log


def test_requests_that_finish_in_time_are_not_cut(tmp_path):
    srv = serve(tmp_path, "--shutdown-timeout", "60")
    streams = start_streams(srv.base_url, 2, {**LONG, "max_tokens": 16})
    sent = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    srv.proc.wait(90)
    assert time.monotonic() - sent < 60, "the server waited for the timeout, not for its requests"
    for thread, events in streams:
        thread.join(10)
        chunks = [e for e in events if isinstance(e, dict) and e.get("choices")]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length", events[-3:]
        assert events[-1] == "[DONE]" and not any(isinstance(e, dict) and "error" in e for e in events)
    assert "ended" not in srv.log


def test_a_second_signal_exits_at_once(tmp_path):
    srv = serve(tmp_path, "--shutdown-timeout", "60")
    streams = start_streams(srv.base_url, 2, LONG)
    srv.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 5
    while httpx.get(srv.base_url + "/health", timeout=10).status_code == 200:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    sent = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    code = srv.proc.wait(30)
    assert time.monotonic() - sent < 5 and code == 128 + signal.SIGTERM, srv.log[-2000:]
    assert "second signal" in srv.log
    for thread, _ in streams:
        thread.join(10)
