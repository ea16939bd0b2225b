"""Two real `kvtool serve` processes (SmolLM2) on one block store folder (--kv-store): the second answers a long
prompt the first one saw with cached_tokens >= 90% and the same greedy text; kill -9 of the first while it
publishes a new prompt's blocks leaves the store whole, and the second still answers from it."""

from __future__ import annotations

import signal
import time

import httpx
import pytest

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

SYSTEM = ("You are a careful assistant for a small bakery. Answer in one or two sentences, quote prices in euros, "
          "and never invent opening hours: the shop opens at 7:00 and closes at 18:00, Monday to Saturday. ") * 12


def ask(base_url: str, question: str) -> dict:
    body = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
            "max_tokens": 6, "temperature": 0}
    r = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def written(base_url: str) -> int:
    return httpx.get(base_url + "/v1/cache", timeout=30).json()["store_written_blocks"]


def test_two_servers_share_one_store_and_a_kill_9_leaves_it_readable(tmp_path):
    from kvtool.cache.dirstore import DirStore
    from kvtool.testing.models import smollm2_gguf
    from kvtool.testing.server_process import ServerProcess

    store = tmp_path / "store"
    args = ["--model", str(smollm2_gguf()), "--kv-store", str(store), "--cache-bytes", str(256 << 20),
            "--log-level", "warning"]
    first = ServerProcess(args, tmp_path / "first.log").start(timeout=300)
    second = ServerProcess(args, tmp_path / "second.log").start(timeout=300)
    try:
        cold = ask(first.base_url, "Which breads do you bake on Saturdays?")
        prompt_tokens = cold["usage"]["prompt_tokens"]
        assert prompt_tokens > 500 and cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        deadline = time.monotonic() + 60
        while written(first.base_url) < prompt_tokens // 16:  # the writer thread publishes after the request
            assert time.monotonic() < deadline, "the first server did not publish its blocks"
            time.sleep(0.2)
        warm = ask(second.base_url, "Which breads do you bake on Saturdays?")
        assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0.9 * prompt_tokens
        assert warm["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]

        # a new prompt (another system prompt start): kill -9 the first server while it publishes its blocks
        body = {"messages": [{"role": "system", "content": "Short answers only. " + SYSTEM},
                             {"role": "user", "content": "Do you sell rye bread?"}], "max_tokens": 1}
        before = written(first.base_url)
        r = httpx.post(first.base_url + "/v1/chat/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        while written(first.base_url) == before:  # its first new block is out: the rest are on their way
            time.sleep(0.01)
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(30)
        DirStore(str(store)).check_integrity()  # every block there is whole
        body["max_tokens"] = 6
        again = httpx.post(second.base_url + "/v1/chat/completions", json=body, timeout=300).json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16  # what was published, read
        stats = httpx.get(second.base_url + "/v1/cache", timeout=30).json()
        assert stats["store_bad_blocks"] == 0 and stats["store_errors"] == 0
    finally:
        for srv in (first, second):
            if srv.proc is not None and srv.proc.poll() is None:
                srv.stop()
