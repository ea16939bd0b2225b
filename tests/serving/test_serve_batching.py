"""The server batches concurrent requests: they share decode steps and still get their solo output."""

from __future__ import annotations

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
