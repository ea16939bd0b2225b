"""One thread owns the Engine; route handlers only submit and await token events.

Fairness: requests are admitted first come, first served, up to `max_active`; the worker
then steps each active Generation one token per round (round robin), each with its own KV
cache, so concurrent streams interleave instead of waiting for each other. A request
admitted this round is stepped first (prefill + first token), which bounds its TTFT by one
round rather than a whole queue of decodes. More than
`max_active + max_queue` requests in flight get QueueFull (HTTP 429) at once.

A cancelled handle (client gone) is closed at its next turn: gen.close() frees its KV.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from typing import AsyncIterator

from kvtool.config import SamplingParams
from kvtool.engine import Engine, Generation, TokenEvent
from kvtool.serving.errors import QueueFull, Unavailable

log = logging.getLogger("kvtool.serving")
_DONE = object()


class WorkerCrash(Exception):
    """The engine failed on a request: a server fault, reported as a 500 / stream error."""


class Handle:
    """One request in the worker: iterate it (async) for TokenEvents; .gen holds the results."""

    def __init__(self, worker: "Worker", gen: Generation, loop: asyncio.AbstractEventLoop):
        self.worker, self.gen, self.loop = worker, gen, loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.done = False
        self.submitted = time.perf_counter()
        self.first_token: float | None = None
        self.last_token: float | None = None
        self._iter = None

    def cancel(self) -> None:
        """Stop generating (idempotent); the worker closes the generation at its next turn."""
        if not self.done:
            self.cancelled.set()
            self.worker._wake(self)

    async def __aiter__(self) -> AsyncIterator[TokenEvent]:
        while True:
            item = await self.queue.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def _post(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is gone (server shut down): nobody is listening
            self.cancelled.set()


class Worker:
    def __init__(self, engine: Engine, max_active: int = 16, max_queue: int = 64, metrics=None):
        self.engine, self.max_active, self.max_queue, self.metrics = engine, max_active, max_queue, metrics
        self._pending: deque[Handle] = deque()
        self._active: list[Handle] = []
        self._cv = threading.Condition()
        self._model_lock = threading.Lock()  # held for each round of steps; run_exclusive() takes it too
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="kvtool-worker", daemon=True)
        self._thread.start()

    @property
    def running(self) -> int:
        return len(self._active)

    @property
    def waiting(self) -> int:
        return len(self._pending)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop

    def submit(self, prompt_ids: list[int], params: SamplingParams, skip_special_tokens: bool = True) -> Handle:
        """Queue a request. Raises KvtoolError (400) for a bad prompt, QueueFull (429), Unavailable (503)."""
        if not self.alive:
            raise Unavailable("the model worker is not running; restart kvtool serve", code="worker_stopped")
        gen = self.engine.generate(prompt_ids, params, skip_special_tokens)  # validates; computes nothing yet
        handle = Handle(self, gen, asyncio.get_running_loop())
        with self._cv:
            if len(self._pending) + len(self._active) >= self.max_active + self.max_queue:
                if self.metrics:
                    self.metrics.rejected()
                raise QueueFull(f"server busy: {len(self._active)} requests running and {len(self._pending)} "
                                f"waiting (max_queue={self.max_queue}); retry shortly", code="queue_full")
            self._pending.append(handle)
            self._cv.notify()
        return handle

    def run_exclusive(self, fn):
        """Run fn() between two rounds of generation steps (e.g. an attention pass of the inspector)."""
        with self._model_lock:
            return fn()

    def stop(self, timeout: float = 5.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout)

    def _wake(self, handle: Handle) -> None:
        with self._cv:
            if handle in self._pending:  # never started: drop it now, freeing its queue slot
                self._pending.remove(handle)
                handle.gen.close()
                self._finish(handle)
            self._cv.notify()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stop and not self._pending and not self._active:
                    self._cv.wait()
                if self._stop:
                    break
                admitted = []
                while self._pending and len(self._active) + len(admitted) < self.max_active:
                    handle = self._pending.popleft()
                    handle.gen.timings.queue_ms = (time.perf_counter() - handle.submitted) * 1000.0
                    handle._iter = iter(handle.gen)
                    admitted.append(handle)
                running = list(self._active)
                self._active += admitted
            # New requests go first in the round (their prefill and first token), then one token each.
            with self._model_lock:
                for handle in admitted + running:
                    self._step(handle)
        for handle in self._active + list(self._pending):
            handle.gen.close()
            handle._post(Unavailable("the server is shutting down", code="shutting_down"))
        self._active, self._pending = [], deque()

    def _step(self, handle: Handle) -> None:
        if handle.cancelled.is_set():
            handle.gen.close()
            self._retire(handle)
            return
        try:
            event = next(handle._iter)
        except StopIteration:
            self._retire(handle)
            return
        except Exception as exc:  # an engine fault on one request must not take the others down
            log.exception("generation failed")
            handle.gen.close()
            handle._post(WorkerCrash(f"generation failed: {type(exc).__name__}: {exc}"))
            self._retire(handle)
            return
        now = time.perf_counter()
        if self.metrics:
            if handle.first_token is None:
                self.metrics.observe_ttft(now - handle.submitted)
            else:
                self.metrics.observe_itl(now - handle.last_token)
        if handle.first_token is None:
            handle.first_token = now
        handle.last_token = now
        handle._post(event)

    def _retire(self, handle: Handle) -> None:
        with self._cv:
            if handle in self._active:
                self._active.remove(handle)
        self._finish(handle)

    def _finish(self, handle: Handle) -> None:
        if handle.done:
            return
        handle.done = True
        if self.metrics:
            self.metrics.finished(handle.gen)
        handle._post(_DONE)
