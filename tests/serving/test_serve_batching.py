"""The server batches concurrent requests: they share decode steps and still get their solo output."""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytestmark = pytest.mark.real_model

QUESTIONS = ["Name a colour.", "What is 2 + 2?", "Say hello in French.", "Name a planet."]


def ask(client, question):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": question}],
                                                  "temperature": 0, "max_tokens": 8, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def test_concurrent_requests_share_decode_steps_and_match_solo(smol, smol_server):
    smol.post("/v1/cache/reset")
    solo = [ask(smol, q) for q in QUESTIONS]
    smol.post("/v1/cache/reset")
    worker = smol_server.app.state.worker
    steps_before = worker.scheduler.steps
    held = threading.Event()

    def hold_model():  # keep the worker from stepping until every request has arrived
        held.set()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and worker.waiting + worker.running < len(QUESTIONS) - 1:
            time.sleep(0.01)
        time.sleep(0.2)

    holder = threading.Thread(target=worker.run_exclusive, args=(hold_model,))
    holder.start()
    held.wait()
    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        batched = list(pool.map(lambda q: ask(smol, q), QUESTIONS))
    holder.join()
    steps = worker.scheduler.steps - steps_before
    total = sum(b["usage"]["completion_tokens"] for b in batched)
    assert total == 8 * len(QUESTIONS)
    assert steps <= total // 2, f"{steps} steps for {total} tokens: requests were not batched"
    for a, b in zip(solo, batched):
        assert b["choices"][0]["message"]["content"] == a["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
def tight_server(smollm2):
    """A server whose KV pool (five 16-token blocks) holds two of these requests, which then outgrow it. Its prefix
    cache is off: a hit's blocks, read in place, are shared, so requests whose prompts share the chat template's first
    blocks with one cached before could all fit, and whether any is preempted would depend on timing."""
    from kvtool.config import EngineConfig
    from kvtool.serving import ServerConfig, create_app
    from kvtool.serving.server import BackgroundServer

    config = ServerConfig(kv_bytes=80 * smollm2.kv_bytes_per_token, max_active=4)
    srv = BackgroundServer(create_app(smollm2, EngineConfig(enable_prefix_cache=False), config)).start()
    yield srv
    srv.stop()


def test_a_small_kv_budget_preempts_and_recomputes_without_changing_outputs(smol, tight_server):
    import httpx

    smol.post("/v1/cache/reset")
    solo = [ask(smol, q) for q in QUESTIONS]
    choices = smol.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": QUESTIONS[0]}],
                                                      "temperature": 0.8, "seed": 5, "n": 3, "max_tokens": 8}).json()
    scheduler = tight_server.app.state.worker.scheduler
    assert scheduler.kv_budget_tokens == 80 == 5 * 16  # the pool's blocks
    with httpx.Client(base_url=tight_server.base_url, timeout=300) as tight:
        with ThreadPoolExecutor(2 * len(QUESTIONS)) as pool:
            batched = list(pool.map(lambda q: ask(tight, q), QUESTIONS * 2))
        for a, b in zip(solo * 2, batched):
            assert b["choices"][0]["message"]["content"] == a["choices"][0]["message"]["content"]
        again = tight.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": QUESTIONS[0]}],
                                                         "temperature": 0.8, "seed": 5, "n": 3, "max_tokens": 8})
        assert [c["message"]["content"] for c in again.json()["choices"]] == \
            [c["message"]["content"] for c in choices["choices"]]
        # the last answer can reach the client a moment before the worker frees that request's KV
        deadline = time.monotonic() + 10
        while "kvtool_kv_tokens_in_use 0" not in (metrics := tight.get("/metrics").text) and time.monotonic() < deadline:
            time.sleep(0.05)
    assert scheduler.preemptions > 0 and f"kvtool_scheduler_preemptions_total {scheduler.preemptions}" in metrics
    assert "kvtool_kv_budget_tokens 80" in metrics and "kvtool_kv_tokens_in_use 0" in metrics


def test_a_request_larger_than_the_kv_pool_is_a_400_that_says_why_and_the_server_goes_on(tight_server):
    import httpx

    with httpx.Client(base_url=tight_server.base_url, timeout=300) as tight:
        big = tight.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "one two " * 60}],
                                                       "max_tokens": 4})
        assert big.status_code == 400
        assert re.search(r"needs KV for at least \d+ tokens, more than it can get alone: the KV pool's 5 blocks "
                         r"\(80 tokens\) are all in use", big.json()["error"]["message"])
        assert ask(tight, QUESTIONS[0])["choices"][0]["finish_reason"] == "length"
