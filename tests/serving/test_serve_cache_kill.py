"""kill -9 at random moments while a real kvtool serve (SmolLM2) saves its prefix cache and answers requests,
over seeded cycles: every restart loads the file, no file is ever refused, and every block a completed save named is
there after the restart (the budget is large, so nothing is evicted: the saved set only grows)."""

from __future__ import annotations

import random
import signal
import threading
import time

import httpx
import pytest

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

CYCLES = 2  # a SmolLM2 server starts in 10-70 s on a shared CPU; tests/cache/test_persist_kill.py runs 20 cycles
WORDS = "river stone cloud paper violet engine marble harbor lantern copper meadow signal orbit".split()


def prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randrange(30, 90)))


def load_and_serve(rng: random.Random, base_url: str, stop: threading.Event, saves: list) -> None:
    """Requests and POST /v1/cache/save, interleaved, until stop or the server dies; saves: each completed
    save's answer."""
    with httpx.Client(base_url=base_url, timeout=30) as client:
        while not stop.is_set():
            try:
                if rng.random() < 0.4:
                    r = client.post("/v1/cache/save")
                    if r.status_code == 200:
                        saves.append(r.json())
                else:
                    client.post("/v1/completions", json={"prompt": prompt(rng), "max_tokens": 2})
            except httpx.HTTPError:
                return


def test_kill_9_during_saves_and_requests_never_loses_a_saved_block(tmp_path):
    from kvtool.cache.persist import describe_file
    from kvtool.testing.models import smollm2_gguf
    from kvtool.testing.server_process import ServerProcess

    path = tmp_path / "prefix.kvc"
    args = ["--model", str(smollm2_gguf()), "--cache-file", str(path), "--cache-save-every", "1",
            "--cache-bytes", str(1 << 30), "--log-level", "warning"]
    named: int | None = None  # blocks the last completed save named
    for cycle in range(CYCLES):
        rng = random.Random(cycle)
        srv = ServerProcess(args, tmp_path / f"serve{cycle}.log").start(timeout=300)
        stats = httpx.get(srv.base_url + "/v1/cache", timeout=30).json()
        if named is not None:  # the restart loaded the file, with at least what the last completed save named
            assert stats["blocks"] >= named, f"cycle {cycle}: {stats['blocks']} blocks loaded, {named} saved"
        stop, saves = threading.Event(), []
        workers = [threading.Thread(target=load_and_serve, args=(random.Random(rng.random()), srv.base_url, stop,
                                                                 saves)) for _ in range(3)]
        for w in workers:
            w.start()
        deadline = time.monotonic() + 120
        while not saves and time.monotonic() < deadline:  # then kill at a random moment of the next ones
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 2.0))
        srv.proc.send_signal(signal.SIGKILL)
        srv.proc.wait(30)
        stop.set()
        for w in workers:
            w.join(60)
        if saves:
            named = max(named or 0, max(s["blocks"] for s in saves))
        # the file on disk is whole whatever the moment of the kill, and names every block of the last save
        if path.exists():
            described = describe_file(path)
            assert described["blocks"] >= (named or 0)
    assert named, "no save completed in any cycle: the test saw nothing"
