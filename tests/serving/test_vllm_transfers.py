"""kvtool.integrations.vllm.transfers: the worker half's thread that writes supplied KV into a request's pages (or copies
a prompt out) beside vLLM's steps. vLLM frees a request's pages, or schedules it, only once get_finished reports it,
so every queued request must come back exactly once, a failed one too, and never while its work still runs."""

from __future__ import annotations

import threading
import time

from kvtool.integrations.vllm.transfers import Transfers


def wait_for(transfers: Transfers, count: int, timeout: float = 30.0) -> set[str]:
    done, end = set(), time.monotonic() + timeout
    while len(done) < count and time.monotonic() < end:
        done |= transfers.take()[0]
        time.sleep(0.01)
    return done


def test_each_request_comes_back_once_after_its_work():
    gate, seen = threading.Event(), []

    def work(layers, item):
        assert layers == ["pages"]
        gate.wait(30)
        if item == "bad":
            raise RuntimeError("the store went away")
        seen.append(item)

    transfers = Transfers("test-transfers", work, ["pages"])
    transfers.put("a", "good")
    transfers.put("b", "bad")
    transfers.put("c", "after")
    done, pending = transfers.take()
    assert done == set() and pending == {"a", "b", "c"}  # still queued or running: vLLM keeps waiting
    gate.set()
    assert wait_for(transfers, 3) == {"a", "b", "c"}  # the failed one too, so its pages are not held forever
    assert seen == ["good", "after"]  # a failure does not stop the thread
    assert transfers.take() == (set(), set())  # reported once
