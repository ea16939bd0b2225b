"""One thread owns the engine core (kvtool.serving.core: kvtool's scheduler or vLLM's engine); route handlers
only submit and await token events.

Continuous batching (kvtool's core): the worker thread drives the engine's own scheduler (Engine.scheduler, set by
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
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import AsyncIterator

from kvtool.config import SamplingParams
from kvtool.engine import Generation, TokenEvent
from kvtool.engine.forks import Fork, choices
from kvtool.errors import KvtoolError
from kvtool.serving.core import EngineCore, Output
from kvtool.serving.errors import QueueFull, ServerFault, ServingError, Unavailable

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


class Worker:
    """The serving side of an engine core (kvtool.serving.core): submit and submit_choices queue requests and hand
    back Handles of TokenEvents; one thread adds them to the core, aborts the cancelled ones and steps it, and posts
    each output to its handle (with the server's metrics: TTFT, inter-token latency, finished generations)."""

    def __init__(self, core: EngineCore, max_queue: int = 64, metrics=None):
        self.core, self.max_queue, self.metrics = core, max_queue, metrics
        self.max_active = core.max_running
        self._pending: deque[Handle] = deque()  # submitted, not yet handed to the core
        self._handles: dict[int, Handle] = {}  # id(gen) -> handle, for everything in the core
        self._open: weakref.WeakSet[Handle] = weakref.WeakSet()  # every unfinished handle (abort_all)
        self._calls: list = []  # run_exclusive() calls for the worker thread
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name=f"{core.name}-worker", daemon=True)
        self._thread.start()

    @property
    def scheduler(self):
        """kvtool's BatchScheduler, for the /metrics gauges (None on vLLM)."""
        return self.core.scheduler

    @property
    def running(self) -> int:
        """Requests admitted and not yet finished (finishing includes handing their KV to the prefix cache)."""
        return max(0, len(self._handles) - self.core.queued)

    @property
    def waiting(self) -> int:
        return len(self._pending) + self.core.queued

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop

    def submit(self, prompt_ids: list[int], params: SamplingParams, skip_special_tokens: bool = True) -> Handle:
        """Queue a request. Raises KvtoolError (400) for a bad prompt, QueueFull (429), Unavailable (503)."""
        return self.submit_choices([prompt_ids], 1, params, skip_special_tokens)[0]

    def submit_choices(self, prompts: list[list[int]], n: int, params: SamplingParams,
                       skip_special_tokens: bool = True, ready: list | None = None) -> Handles:
        """Queue n choices of each prompt, all or none: handle p * n + i is choice i of prompt p, seed s + i. On
        kvtool's core a prompt's choices prefill it once (a shared Fork), on vLLM's its prefix cache shares the
        prompt's blocks. ready: what set_up() made of these arguments (enqueue() makes it off the event loop)."""
        total, capacity = self._admissible(len(prompts), n)
        loop, handles = asyncio.get_running_loop(), Handles()
        for gen, max_tokens, fork in ready if ready is not None else self.set_up(prompts, n, params):
            handles.append(Handle(self, gen, max_tokens, skip_special_tokens, loop,
                                  fork if self.core.shares_forks else None))
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

    async def enqueue(self, prompts: list[list[int]], n: int, params: SamplingParams,
                      skip_special_tokens: bool = True) -> Handles:
        """submit_choices, the setup (validation, a grammar's compile and first mask) on a thread: a large JSON
        schema does not hold up the other streams."""
        self._admissible(len(prompts), n)
        ready = await asyncio.to_thread(self.set_up, prompts, n, params)
        if params.unenforced:  # the client hears it too: the response's header and timings.structured_output
            log.warning("structured output enforces the JSON schema without %s",
                        "; ".join(map(str, params.unenforced)))
        return self.submit_choices(prompts, n, params, skip_special_tokens, ready)

    def _admissible(self, prompts: int, n: int) -> tuple[int, int]:  # 503 (worker gone) or check_count's 400
        if not self.alive:
            raise Unavailable(f"the {self.core.name} engine worker is not running; restart kvtool serve",
                              code="worker_stopped")
        return check_count(prompts, n, self.max_active, self.max_queue)

    def set_up(self, prompts: list[list[int]], n: int, params: SamplingParams) -> list:
        """[(Generation, max_tokens, fork)] of each choice, validated, its grammar matcher set up; runs no model."""
        try:
            return [(*self.core.new_generation(i, c), f) for i, c, f in choices(prompts, [params] * len(prompts), n)]
        except KvtoolError:
            raise
        except Exception as exc:  # a fault setting up this request: its own 500, the connection kept
            log.exception("setting up a request failed")
            raise ServerFault(f"internal server error: {type(exc).__name__}: {exc}") from exc

    def run_exclusive(self, fn, timeout: float | None = None):
        """fn() on the worker thread between two steps, so nothing else runs the engine meanwhile (an attention
        pass of the inspector, a cache edit, a prefix-cache reset); its result. Unavailable (503) when the worker
        is not running, or did not finish fn within `timeout` seconds."""
        if threading.current_thread() is self._thread:
            return fn()
        done: Future = Future()
        with self._cv:
            if not self.alive:
                raise Unavailable(f"the {self.core.name} engine worker is not running", code="worker_stopped")
            self._calls.append((fn, done))
            self._cv.notify()
        try:
            return done.result(timeout)
        except FutureTimeout:
            raise Unavailable("the engine did not take the call in time", code="engine_busy") from None

    def stop(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout)

    def abort_all(self, error: BaseException) -> int:
        """End every unfinished handle now: its reader gets ``error`` next (ahead of anything the engine posts
        later) and its generation is cancelled, which frees its KV. Returns how many were ended."""
        with _OPEN_LOCK:
            handles = [h for h in list(self._open) if not h.done and not h.cancelled.is_set()]
        for handle in handles:
            handle._post(error)
            handle.cancel()
        return len(handles)

    def _track(self, handle: Handle) -> None:
        with _OPEN_LOCK:
            self._open.add(handle)  # a handle refused at submit (queue full) goes with its request

    def _wake(self, handle: Handle) -> None:
        with self._cv:
            if handle in self._pending:  # never started: drop it now, freeing its queue slot
                self._pending.remove(handle)
                handle.gen.close()
                self._finish(handle)
            self._cv.notify()

    def _loop(self) -> None:
        core = self.core
        while True:
            with self._cv:
                while not self._stop and not self._pending and not self._calls and core.idle:
                    self._cv.wait()
                if self._stop:
                    break
                new, self._pending = list(self._pending), deque()
                calls, self._calls = self._calls, []
                for handle in new:
                    self._handles[id(handle.gen)] = handle
            for fn, done in calls:
                try:
                    done.set_result(fn())
                except BaseException as exc:  # handed to the caller, which raises it
                    done.set_exception(exc)
            now = time.perf_counter()
            for handle in new:
                handle.gen.timings.queue_ms = (now - handle.submitted) * 1000.0
                try:
                    core.add(handle)
                except Exception as exc:  # setting it up failed (or the engine refused it): this request alone ends
                    log.warning("request setup failed: %s: %s", type(exc).__name__, exc)
                    self._deliver([Output(handle.gen, finished=True, error=exc)])
            try:
                self._deliver(core.abort([h.gen for h in self._handles.values() if h.cancelled.is_set()]))
                self._deliver(core.step())
            except Exception as exc:  # the step failed: end what runs, keep serving
                log.exception("engine step failed")
                self._deliver(core.fail(exc))
        self._deliver(core.abort([h.gen for h in self._handles.values()]))
        for handle in list(self._pending):
            handle.gen.close()
            self._finish(handle, Unavailable("the server is shutting down", code="shutting_down"))
        self._pending = deque()
        for _, done in self._calls:
            done.set_exception(Unavailable("the server is shutting down", code="shutting_down"))

    def _deliver(self, outputs: list[Output]) -> None:
        for out in outputs:
            handle = self._handles.get(id(out.gen))
            if handle is None:
                continue
            if out.event is not None:
                self._emit(handle, out.event)
            if out.finished:
                del self._handles[id(out.gen)]
                self._finish(handle, self._error(handle, out.error))

    def _error(self, handle: Handle, error: BaseException | None) -> BaseException | None:
        """What the reader of a finished handle is told: a ServingError as it is, a KvtoolError (the request asked
        for what cannot be done, e.g. a dead-end pattern) as a 400, anything else as a 500; a request ended by
        shutting down (not by its client) as a 503."""
        if isinstance(error, ServingError):
            return error
        if isinstance(error, KvtoolError):
            log.warning("request failed: %s", error)
            return RequestFailed(str(error), getattr(error, "param", None))
        if error is not None:
            log.error("generation failed: %s: %s", type(error).__name__, error)
            return WorkerCrash(f"generation failed: {type(error).__name__}: {error}")
        if self._stop and handle.gen.finish_reason == "abort" and not handle.cancelled.is_set():
            return Unavailable("the server is shutting down", code="shutting_down")
        return None

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
            self._open.discard(handle)
        if error is not None:
            handle._post(error)
        if self.metrics:
            self.metrics.finished(handle.gen)
        handle._post(_DONE)
