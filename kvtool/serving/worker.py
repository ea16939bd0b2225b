"""One thread owns the Engine; route handlers only submit and await token events.

Continuous batching: the worker thread drives the engine's own scheduler (Engine.scheduler, set by
EngineConfig as in the Python API). Every step is one packed forward holding one decode token of each
running request plus prefill chunks of newly admitted ones (at most `prefill_chunk` prompt tokens per
step), so concurrent streams share decode steps and a long prompt does not stall the streams already
running. Requests are admitted first come, first served, up to `max_running` at once; more than
`max_running + max_queue` requests in flight get QueueFull (HTTP 429) at once. Their KV stays inside
`kv_bytes`: past it, the scheduler preempts the newest request.

The n choices of a request (and the prompts of a batched completion) are submitted together, all or
none; the choices of one prompt share a Fork, so the prompt is prefilled once for all of them.

A cancelled handle (client gone) leaves the batch before the next step, which frees its KV.
A fault in one request's sampling ends that request alone; a fault in the batched forward
ends the requests in that batch, with a 500-style error each; the worker keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref
from collections import deque
from typing import AsyncIterator

from kvtool.config import SamplingParams
from kvtool.engine import Engine, Generation, TokenEvent
from kvtool.engine.forks import Fork, choices
from kvtool.errors import KvtoolError
from kvtool.models.host import release_openmp_threads
from kvtool.serving.errors import QueueFull, ServingError, Unavailable

log = logging.getLogger("kvtool.serving")
_DONE = object()
_OPEN_LOCK = threading.Lock()  # the open handles are added on the event loop and dropped on a worker thread


class RequestFailed(ServingError):
    """The engine could not do what the request asked (e.g. a pattern no token can continue): a 400."""

    status_code = 400


class WorkerCrash(ServingError):
    """The engine failed on a request: a server fault, reported as a 500 / stream error."""

    status_code = 500


class Handle:
    """One request in the worker: iterate it (async) for TokenEvents; .gen holds the results."""

    def __init__(self, worker: "Worker", gen: Generation, max_tokens: int, skip_special_tokens: bool,
                 loop: asyncio.AbstractEventLoop, fork: Fork | None = None):
        self.worker, self.gen, self.loop, self.fork = worker, gen, loop, fork
        self.max_tokens, self.skip_special_tokens = max_tokens, skip_special_tokens
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.done = False
        self.submitted = time.perf_counter()
        self.first_token: float | None = None
        self.last_token: float | None = None
        worker._track(self)

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


class Handles(list):
    """The handles of one HTTP request, choice by choice: cancel() cancels them all."""

    def cancel(self) -> None:
        for handle in self:
            handle.cancel()


def check_count(prompts: int, n: int, max_active: int, max_queue: int) -> tuple[int, int]:
    """(sequences a request asks for, sequences the server holds); a 400 when n is bad or the request alone
    is more than the server ever holds."""
    total, capacity = prompts * n, max_active + max_queue
    if n < 1:
        raise ServingError(f"n must be >= 1, got {n}", param="n")
    if total > capacity:
        raise ServingError(f"{prompts} prompt(s) x n={n} = {total} sequences; this server takes at most "
                           f"{capacity} at once (--max-active + --max-queue)", param="n")
    return total, capacity


class EventSink:
    """What every engine's worker does with a handle's events: metrics (TTFT, inter-token latency, finished
    generations) and posting to the handle's queue; and ending every open handle at once (abort_all, the
    server's shutdown past --shutdown-timeout). Needs `self.metrics` (a ServerMetrics or None)."""

    metrics = None
    _open: "weakref.WeakSet[Handle] | None" = None

    def _track(self, handle: Handle) -> None:
        with _OPEN_LOCK:
            if self._open is None:
                self._open = weakref.WeakSet()  # a handle refused at submit (queue full) goes with its request
            self._open.add(handle)

    def abort_all(self, error: BaseException) -> int:
        """End every unfinished handle now: its reader gets ``error`` next (ahead of anything the engine posts
        later) and its generation is cancelled, which frees its KV. Engine-agnostic: only Handle is used.
        Returns how many were ended."""
        with _OPEN_LOCK:
            handles = [h for h in list(self._open or ()) if not h.done and not h.cancelled.is_set()]
        for handle in handles:
            handle._post(error)
            handle.cancel()
        return len(handles)

    def _emit(self, handle: Handle, event: TokenEvent) -> None:
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

    def _finish(self, handle: Handle, error: BaseException | None = None) -> None:
        if handle.done:
            return
        handle.done = True
        with _OPEN_LOCK:
            if self._open is not None:
                self._open.discard(handle)
        if error is not None:
            handle._post(error)
        if self.metrics:
            self.metrics.finished(handle.gen)
        handle._post(_DONE)


class Worker(EventSink):
    def __init__(self, engine: Engine, max_queue: int = 64, metrics=None):
        self.engine, self.max_queue, self.metrics = engine, max_queue, metrics
        self.max_active = engine.config.max_running
        self.scheduler = engine.scheduler
        self._pending: deque[Handle] = deque()  # submitted, not yet handed to the scheduler
        self._handles: dict[int, Handle] = {}  # id(gen) -> handle, for everything in the scheduler
        self._cv = threading.Condition()
        self._model_lock = threading.Lock()  # held for each batched step; run_exclusive() takes it too
        self._stop = False
        release_openmp_threads()  # the model was loaded on this thread; from here on the worker runs it
        self._thread = threading.Thread(target=self._loop, name="kvtool-worker", daemon=True)
        self._thread.start()

    @property
    def running(self) -> int:
        """Requests admitted and not yet finished (finishing includes handing their KV to the prefix cache)."""
        return max(0, len(self._handles) - len(self.scheduler.waiting))

    @property
    def waiting(self) -> int:
        return len(self._pending) + len(self.scheduler.waiting)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop

    def submit(self, prompt_ids: list[int], params: SamplingParams, skip_special_tokens: bool = True) -> Handle:
        """Queue a request. Raises KvtoolError (400) for a bad prompt, QueueFull (429), Unavailable (503)."""
        return self.submit_choices([prompt_ids], 1, params, skip_special_tokens)[0]

    def submit_choices(self, prompts: list[list[int]], n: int, params: SamplingParams,
                       skip_special_tokens: bool = True) -> Handles:
        """Queue n choices of each prompt, all or none: handle p * n + i is choice i of prompt p. A seed s
        becomes s + i for choice i; the choices of one prompt prefill it once (a shared Fork)."""
        if not self.alive:
            raise Unavailable("the model worker is not running; restart kvtool serve", code="worker_stopped")
        total, capacity = check_count(len(prompts), n, self.max_active, self.max_queue)
        loop, handles = asyncio.get_running_loop(), Handles()
        for ids, choice, fork in choices(prompts, [params] * len(prompts), n):
            gen, max_tokens = self.engine.new_generation(ids, choice)  # validates; computes nothing yet
            handles.append(Handle(self, gen, max_tokens, skip_special_tokens, loop, fork))
        with self._cv:
            if len(self._pending) + len(self._handles) + total > capacity:
                if self.metrics:
                    self.metrics.rejected()
                raise QueueFull(f"server busy: {len(self._pending) + len(self._handles)} sequences in flight "
                                f"({self.running} running, {self.waiting} waiting) and this request adds {total}; "
                                f"it holds at most {capacity} (--max-active {self.max_active} + --max-queue "
                                f"{self.max_queue}); retry shortly", code="queue_full")
            self._pending.extend(handles)
            self._cv.notify()
        return handles

    def run_exclusive(self, fn):
        """Run fn() between two batched steps (e.g. an attention pass of the inspector)."""
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
                while not self._stop and not self._pending and self.scheduler.idle:
                    self._cv.wait()
                if self._stop:
                    break
                new, self._pending = list(self._pending), deque()
                for handle in new:
                    self._handles[id(handle.gen)] = handle
            with self._model_lock:
                now = time.perf_counter()
                for handle in new:
                    handle.gen.timings.queue_ms = (now - handle.submitted) * 1000.0
                    try:
                        self.scheduler.add(handle.gen, handle.max_tokens, handle.skip_special_tokens,
                                           on_event=lambda event, h=handle: self._emit(h, event),
                                           on_finish=self._on_finish, fork=handle.fork)
                    except Exception as exc:  # setting up its sampling failed: this request alone ends
                        log.exception("request setup failed")
                        self._on_finish(handle.gen, exc)
                for req in self.scheduler.requests:
                    if self._handles[id(req.gen)].cancelled.is_set():
                        self.scheduler.cancel(req.gen)
                try:
                    self.scheduler.step()
                except Exception as exc:  # the batched forward failed: end this batch, keep serving
                    log.exception("batched step failed")
                    self._end_running(exc)
        for req in self.scheduler.requests:
            self.scheduler.cancel(req.gen)
        for handle in list(self._pending):
            handle.gen.close()
            self._finish(handle, Unavailable("the server is shutting down", code="shutting_down"))
        self._pending = deque()

    def _end_running(self, exc: BaseException) -> None:
        """End every running request with exc; one that fails to end is dropped, so the loop keeps serving."""
        for req in list(self.scheduler.running):
            try:
                self.scheduler.cancel(req.gen, "error", exc)
            except Exception:
                log.exception("ending a failed request failed")
                if req in self.scheduler.running:
                    self.scheduler.running.remove(req)
                handle = self._handles.pop(id(req.gen), None)
                if handle is not None:
                    handle._post(WorkerCrash(f"generation failed: {type(exc).__name__}: {exc}"))
                    self._finish(handle)

    def _on_finish(self, gen: Generation, error: BaseException | None) -> None:
        handle = self._handles.pop(id(gen))
        if isinstance(error, KvtoolError):  # the request asked for what cannot be done (e.g. a dead-end pattern)
            log.warning("request failed: %s", error)
            handle._post(RequestFailed(str(error), getattr(error, "param", None)))
        elif error is not None:
            log.error("generation failed: %s: %s", type(error).__name__, error)
            handle._post(WorkerCrash(f"generation failed: {type(error).__name__}: {error}"))
        elif self._stop and gen.finish_reason == "abort" and not handle.cancelled.is_set():
            handle._post(Unavailable("the server is shutting down", code="shutting_down"))
        self._finish(handle)
