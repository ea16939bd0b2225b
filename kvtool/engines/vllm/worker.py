"""VllmWorker: the serving Worker's seam (submit / submit_choices -> Handles of TokenEvents) over vLLM.

One thread owns vLLM's LLMEngine (in-process engine core): between two engine steps it adds the
submitted requests and aborts the cancelled ones, then steps; vLLM does the scheduling (continuous
batching, chunked prefill, automatic prefix caching) and the forward passes. Each new token id goes
through kvtool's OutputText, so pieces, text, stop strings, timings and finish reasons are kvtool's.
Cached tokens are vLLM's own count (RequestOutput.num_cached_tokens); with kvtool's KV connector installed,
its account of the request splits them into vLLM's prefix cache plus the kvtool store (cached) and the skill
blocks it supplied (skill_block_tokens).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import replace

from kvtool.config import SamplingParams, as_sampling_params
from kvtool.engine import Generation
from kvtool.engine.forks import choice_seed
from kvtool.engine.generate import check_request
from kvtool.engine.output import OutputText
from kvtool.engines.vllm.sampling import prompt_rows, to_vllm, top_list
from kvtool.ids import as_token_ids
from kvtool.serving.errors import QueueFull, Unavailable
from kvtool.serving.worker import EventSink, Handle, Handles, RequestFailed, WorkerCrash, check_count

log = logging.getLogger("kvtool.serving")
ENGINE_NAME = "vllm"


class VllmRequest:
    """A handle's vLLM side: its request id and the OutputText that turns its token ids into events."""

    def __init__(self, handle: Handle, request_id: str, output: OutputText):
        self.handle, self.request_id, self.output = handle, request_id, output


class VllmWorker(EventSink):
    def __init__(self, engine, model, max_active: int = 16, max_queue: int = 64, metrics=None, side=None):
        """engine: a vllm LLMEngine; model: the TextModel (tokenizer, end of turn, context window) it serves;
        side: the KvtoolSide of kvtool's connector, if installed (its per-request accounts)."""
        self.engine, self.model, self.metrics, self.side = engine, model, metrics, side
        self.max_active, self.max_queue = max_active, max_queue
        self.end_of_turn = frozenset(model.end_of_turn_ids())
        self.specials = {a.content: i for i, a in model.tokenizer.added_tokens_decoder.items()}
        self.scheduler = None  # (kvtool's BatchScheduler gauges: none here; vLLM's metrics are exposed instead)
        self._pending: deque[Handle] = deque()
        self._live: dict[str, VllmRequest] = {}  # vLLM request id -> request
        self._by_handle: dict[int, VllmRequest] = {}
        self._ids = itertools.count()
        self._calls: list = []  # run_exclusive() functions for the worker thread
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="kvtool-vllm-worker", daemon=True)
        self._thread.start()

    @property
    def running(self) -> int:
        return len(self._live)

    @property
    def waiting(self) -> int:
        return len(self._pending)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop

    def stop_ids(self, params: SamplingParams) -> set[int]:
        return set(params.stop_token_ids) | (set() if params.ignore_eos else self.end_of_turn)

    def submit(self, prompt_ids: list[int], params: SamplingParams, skip_special_tokens: bool = True) -> Handle:
        return self.submit_choices([prompt_ids], 1, params, skip_special_tokens)[0]

    def submit_choices(self, prompts: list[list[int]], n: int, params: SamplingParams,
                       skip_special_tokens: bool = True) -> Handles:
        """n choices of each prompt, all or none (handle p * n + i is choice i of prompt p, seeded seed + i);
        each choice is its own vLLM request (vLLM's prefix cache shares the prompt's blocks)."""
        if not self.alive:
            raise Unavailable("the vLLM engine worker is not running; restart kvtool serve", code="worker_stopped")
        total, capacity = check_count(len(prompts), n, self.max_active, self.max_queue)
        loop, handles = asyncio.get_running_loop(), Handles()
        params = as_sampling_params(params).validate()
        for ids in prompts:
            ids = as_token_ids(ids)
            for i in range(n):
                choice = replace(params, seed=choice_seed(params.seed, i)) if i else params
                max_tokens = check_request(ids, choice, self.model.context_window, self.model.spec.vocab_size,
                                           self.stop_ids(choice))
                gen = Generation(prompt_ids=ids, params=choice)
                handles.append(Handle(self, gen, max_tokens, skip_special_tokens, loop))
        with self._cv:
            if len(self._pending) + len(self._live) + total > capacity:
                if self.metrics:
                    self.metrics.rejected()
                raise QueueFull(f"server busy: {len(self._pending) + len(self._live)} sequences in flight and this "
                                f"request adds {total}; it holds at most {capacity} (--max-active "
                                f"{self.max_active} + --max-queue {self.max_queue}); retry shortly", code="queue_full")
            self._pending.extend(handles)
            self._cv.notify()
        return handles

    def run_exclusive(self, fn, timeout: float = 60.0):
        """fn(engine) on the worker thread between two engine steps (e.g. a prefix-cache reset); its result."""
        done, box = threading.Event(), {}

        def call():
            try:
                box["value"] = fn(self.engine)
            except Exception as exc:
                box["error"] = exc
            done.set()

        with self._cv:
            self._calls.append(call)
            self._cv.notify()
        if not done.wait(timeout):
            raise Unavailable("the vLLM engine did not take the call in time", code="engine_busy")
        if "error" in box:
            raise box["error"]
        return box["value"]

    def stop(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout)

    def _wake(self, handle: Handle) -> None:  # Handle.cancel(): the loop aborts it before the next step
        with self._cv:
            if handle in self._pending:
                self._pending.remove(handle)
                handle.gen.finish_reason = handle.gen.finish_reason or "abort"
                self._finish(handle)
            self._cv.notify()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stop and not self._pending and not self._live and not self._calls:
                    self._cv.wait()
                if self._stop:
                    break
                new, self._pending = list(self._pending), deque()
                calls, self._calls = self._calls, []
            for call in calls:
                call()
            try:
                self._admit(new)
                self._abort([r for r in self._live.values() if r.handle.cancelled.is_set()])
                if self._live:
                    for out in self.engine.step():
                        self._on_output(out)
                    if self._live and not self.engine.has_unfinished_requests():  # never spin on lost requests
                        for req in list(self._live.values()):
                            self._end(req, WorkerCrash("vLLM dropped the request without an answer"))
            except Exception as exc:  # the engine step failed: end what runs, keep serving
                log.exception("vLLM engine step failed")
                for req in list(self._live.values()):
                    self._end(req, WorkerCrash(f"generation failed: {type(exc).__name__}: {exc}"))
        self._abort(list(self._live.values()), Unavailable("the server is shutting down", code="shutting_down"))
        for handle in list(self._pending):
            self._finish(handle, Unavailable("the server is shutting down", code="shutting_down"))
        self._pending = deque()

    def _admit(self, handles: list[Handle]) -> None:
        now = time.perf_counter()
        for handle in handles:
            gen = handle.gen
            gen.timings.queue_ms = (now - handle.submitted) * 1000.0
            output = OutputText(self.model.tokenizer, self.stop_ids(gen.params), gen, handle.max_tokens,
                                handle.skip_special_tokens, handle.submitted)
            rid = f"kvtool-{next(self._ids)}"  # outputs and aborts use this id (vLLM keeps its own inside)
            try:
                params = to_vllm(gen.params, handle.max_tokens, output.stops, self.specials)
                self.engine.add_request(rid, {"prompt_token_ids": gen.prompt_ids}, params)
            except Exception as exc:  # vLLM refused the request (e.g. a schema its grammar backend cannot take)
                log.warning("vLLM refused a request: %s: %s", type(exc).__name__, exc)
                handle._post(RequestFailed(f"vLLM refused the request: {exc}"))
                self._finish(handle)
                continue
            req = VllmRequest(handle, rid, output)
            self._live[rid] = req

    def _abort(self, reqs: list[VllmRequest], error: BaseException | None = None) -> None:
        if not reqs:
            return
        try:
            self.engine.abort_request([r.request_id for r in reqs])
        except Exception:
            log.exception("aborting vLLM requests failed")
        for req in reqs:
            req.handle.gen.finish_reason = req.handle.gen.finish_reason or "abort"
            self._end(req, error)

    def _on_output(self, out) -> None:
        req = self._live.get(out.request_id)
        if req is None:
            return
        gen, output = req.handle.gen, req.output
        if out.prompt_logprobs is not None and gen.params.prompt_logprobs is not None and gen.prompt_logprobs is None:
            gen.prompt_logprobs = prompt_rows(gen.prompt_ids, out.prompt_logprobs, gen.params.prompt_logprobs)
        completion = out.outputs[0] if out.outputs else None
        if completion is not None:
            if output.t_first is None and completion.token_ids:
                self._account(req, out.num_cached_tokens or 0)
            lps = completion.logprobs or []
            for j, tok in enumerate(completion.token_ids):
                if gen.finish_reason:
                    break
                entry = lps[j] if j < len(lps) else None
                own = entry.get(tok) if entry else None
                event = output.take(tok, None if own is None else own.logprob,
                                    top_list(entry, gen.params.logprobs) if gen.params.logprobs is not None else None)
                self._emit(req.handle, event)
            if gen.timings.ttft_ms and not gen.timings.prefill_ms:
                gen.timings.prefill_ms = gen.timings.ttft_ms - gen.timings.queue_ms
        if gen.finish_reason and not out.finished:  # kvtool's stop came first (e.g. a stop string)
            self._abort([req])
        elif out.finished:
            if gen.finish_reason is None:
                gen.finish_reason = completion.finish_reason if completion and completion.finish_reason in (
                    "stop", "length") else "abort"
            self._end(req)

    def _account(self, req: VllmRequest, cached: int) -> None:
        gen, n = req.handle.gen, len(req.handle.gen.prompt_ids)
        acc = self.side.take_account(req.request_id) if self.side is not None else None
        if acc is None:
            gen.timings.account(n, min(cached, n))
            return
        gen.timings.account(n, min(acc.local + acc.stored, n))
        gen.timings.skill_block_tokens = acc.block_tokens
        if self.side.catalog is not None:
            gen.timings.skill_path, gen.timings.skill_path_reason = acc.skill_path, acc.skill_reason
        gen.timings.prefill_tokens = n - gen.timings.cached_tokens - acc.block_tokens

    def _end(self, req: VllmRequest, error: BaseException | None = None) -> None:
        self._live.pop(req.request_id, None)
        self._finish(req.handle, error)
