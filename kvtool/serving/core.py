"""The engine-core protocol: what the serving Worker drives, on kvtool's engine (KvtoolCore, here) or on vLLM's
(kvtool.integrations.vllm.worker.VllmCore).

A core validates a request (`new_generation`), takes it (`add`), ends requests early (`abort`) and runs one step
(`step`). `step`, `abort` and `fail` return the outputs produced since the last call: a token event of a request,
its end, or both; an output's error says why the request failed (the Worker turns it into an HTTP error). Only the
worker thread calls a core; the Worker holds the handles, the queue, the metrics and the HTTP side.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

from kvtool.config import SamplingParams
from kvtool.engine import Engine, Generation, TokenEvent
from kvtool.engine.scheduler import BatchScheduler
from kvtool.models.host import release_openmp_threads

log = logging.getLogger("kvtool.serving")


@dataclass
class Output:
    """What a step produced for one request: a token event, its end (finished), or both."""

    gen: Generation
    event: TokenEvent | None = None
    finished: bool = False
    error: BaseException | None = None


class EngineCore(Protocol):
    name: str
    max_running: int  # requests running at once
    shares_forks: bool  # the n choices of a prompt share one Fork (else each is its own request)
    scheduler: BatchScheduler | None  # kvtool's scheduler, for its /metrics gauges (None on vLLM)
    queued: int  # requests taken and not running yet
    idle: bool  # nothing to step

    def new_generation(self, prompt_ids: list[int], params: SamplingParams) -> tuple[Generation, int]:
        """Validate a request (KvtoolError for bad input): its Generation and effective max_tokens."""

    def add(self, req) -> None:
        """Take a request (the Worker's Handle: gen, max_tokens, skip_special_tokens, fork, submitted); an
        exception fails this request alone."""

    def abort(self, gens: list[Generation]) -> list[Output]: ...  # end these now (finish reason: abort)

    def step(self) -> list[Output]: ...  # one step (no forward when idle)

    def fail(self, error: BaseException) -> list[Output]: ...  # after a step raised: end what runs with `error`


class KvtoolCore:
    """kvtool's engine as an engine core: its BatchScheduler (Engine.scheduler, the one the Python API uses)."""

    name = "kvtool"
    shares_forks = True

    def __init__(self, engine: Engine):
        self.engine, self.scheduler = engine, engine.scheduler
        self.max_running = engine.config.max_running
        self._out: list[Output] = []
        release_openmp_threads()  # the model was loaded on this thread; from here on the worker thread runs it

    def new_generation(self, prompt_ids: list[int], params: SamplingParams) -> tuple[Generation, int]:
        return self.engine.new_generation(prompt_ids, params)

    @property
    def queued(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def idle(self) -> bool:
        return self.scheduler.idle and not self._out

    def add(self, req) -> None:
        gen = req.gen
        self.scheduler.add(gen, req.max_tokens, req.skip_special_tokens, shared=req.fork,
                           on_event=lambda event: self._out.append(Output(gen, event)), on_finish=self._finished)

    def abort(self, gens: list[Generation]) -> list[Output]:
        for gen in gens:
            self.scheduler.cancel(gen)
        return self._take()

    def step(self) -> list[Output]:
        if not self.scheduler.idle:
            self.scheduler.step()
        return self._take()

    def fail(self, error: BaseException) -> list[Output]:
        """End the requests the failed step ran; when none ran (it failed admitting them), the waiting ones,
        which would otherwise fail the same way at every step while the worker spins."""
        sched = self.scheduler
        for req in list(sched.running) or list(sched.waiting):
            try:
                sched.cancel(req.gen, "error", error)
            except Exception:  # ending it failed too: drop it, so the worker keeps serving
                log.exception("ending a failed request failed")
                for queue in (sched.running, sched.waiting):
                    if req in queue:
                        queue.remove(req)
                self._out.append(Output(req.gen, finished=True, error=error))
        return self._take()

    def _finished(self, gen: Generation, error: BaseException | None) -> None:
        self._out.append(Output(gen, finished=True, error=error))

    def _take(self) -> list[Output]:
        out, self._out = self._out, []
        return out
