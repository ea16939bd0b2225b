"""Continuous batching, planned: which requests run in a step, which tokens of each, and what their results do.

schedule() admits waiting requests first come, first served (each opens its KV then, Engine.open_cache: a prefix-cache
lookup, so requests arriving together read what the first published) and returns a Plan: a decode token of each
running request plus prefill chunks within `prefill_budget` tokens. A step's blocks come from the engine's pool before
its forward; where it has none left the newest request is preempted (its KV dropped, it re-queues at the front to be
recomputed). The engine's StepExecutor runs the Plan; postprocess() takes its samples: each token goes out as a
TokenEvent, finished requests leave, and a fault while taking one request's token ends that request alone.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable

import torch

from kvtool.config import SamplingParams, is_whole
from kvtool.engine.output import Generation, OutputState, TokenEvent, scores_prompt
from kvtool.engine.plan import BatchRequest, Chunk, Plan, SharedPrompt
from kvtool.engine.sampling import Sample
from kvtool.engine.scoring import SCORE_CHUNK, PromptScorer
from kvtool.errors import InvalidParameterError, PoolExhausted


class BatchScheduler:
    """The batch of an engine: schedule() plans, postprocess() applies; step() runs them through Engine.executor."""

    def __init__(self, engine, max_running: int = 16, prefill_budget: int = 256, kv_budget_tokens: int | None = None):
        for name, value in (("max_running", max_running), ("prefill_budget", prefill_budget),
                            ("kv_budget_tokens", 1 if kv_budget_tokens is None else kv_budget_tokens)):
            if not is_whole(value, 1):
                raise InvalidParameterError(f"{name} must be an integer >= 1, got {value!r}")
        self.engine, self.max_running, self.prefill_budget = engine, max_running, prefill_budget
        self._kv_budget = kv_budget_tokens  # a cap in tokens (an engine without a sized pool gives one)
        self.waiting: deque[BatchRequest] = deque()
        self.running: list[BatchRequest] = []
        self.steps, self.preemptions = 0, 0  # preemptions: requests whose KV was dropped for room (recomputed)
        self.kv_in_use = 0  # _kv_tokens() after the last step, for readers on other threads
        self.full = False  # the pool refused a block: none is admitted until a request leaves
        self.host_s = 0.0  # time steps spent outside the forward and the token read (scheduling, detokenizing)

    def submit(self, prompt_ids: list[int], params: SamplingParams | None = None, *args, **kwargs) -> Generation:
        """Validate and queue a request (KvtoolError for bad input; the rest as add()); returns its Generation."""
        gen, max_tokens = self.engine.new_generation(prompt_ids, params)
        self.add(gen, max_tokens, *args, **kwargs)
        return gen

    def add(self, gen: Generation, max_tokens: int, skip_special_tokens: bool = True,
            on_event: Callable[[TokenEvent], None] | None = None,
            on_finish: Callable[[Generation, BaseException | None], None] | None = None,
            shared: SharedPrompt | None = None) -> None:
        """Queue a Generation Engine.new_generation() validated; requests given one `shared` prompt prefill it once."""
        state = OutputState(self.engine, gen, max_tokens, skip_special_tokens, time.perf_counter())
        req = BatchRequest(gen, state, on_event, on_finish, pending=list(gen.prompt_ids), shared=shared)
        if shared is not None:
            shared.join(req, self.engine)
        self.waiting.append(req)

    @property
    def kv_budget_tokens(self) -> int | None:
        """The KV running requests may hold, in tokens: the cap given, else what the engine's sized pool holds."""
        pool = self.engine.pool
        return self._kv_budget if self._kv_budget is not None or not pool.blocks else pool.blocks * pool.block_shape[3]

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    @property
    def requests(self) -> list[BatchRequest]:
        return [*self.running, *self.waiting]

    def cancel(self, gen: Generation, reason: str = "abort", error: BaseException | None = None) -> None:
        for queue in (self.running, self.waiting):
            for req in list(queue):
                if req.gen is gen:
                    queue.remove(req)
                    self._finish(req, reason, error)

    def step(self) -> int:
        """Schedule, execute, postprocess: one batched step; returns the number of tokens it forwarded."""
        t0, executed_s = time.perf_counter(), 0.0
        while (plan := self.schedule()).given:  # choices starting from a shared prompt: first tokens, then the step
            executed_s += self._execute(plan)
        if plan.chunks:
            executed_s += self._execute(plan)
        if executed_s:
            self.host_s += time.perf_counter() - t0 - executed_s
        self.kv_in_use = self._kv_tokens()
        return plan.tokens

    def _execute(self, plan: Plan) -> float:
        logits, samples, seconds = self.engine.executor.run(plan)
        self.postprocess(plan, logits, samples)
        return seconds

    def run(self) -> None:
        while not self.idle:
            self.step()

    def schedule(self) -> Plan:
        """Admit what fits. Where some start from a shared prompt's logits, the Plan is only those (first tokens come
        first); else each running request's chunk (decodes, prefills within the budget, oldest first), made to fit."""
        plan = Plan()
        self._admit(plan)
        if plan.given:
            return plan
        budget = self.prefill_budget
        for req in sorted(self.running, key=lambda r: r.admitted_at):
            if len(req.pending) == 1:  # decoding
                plan.chunks.append(Chunk(req, req.pending, True))
            elif budget > 0:
                chunk = req.pending[: min(budget, SCORE_CHUNK) if req.scorer is not None else budget]
                budget -= len(chunk)
                plan.chunks.append(Chunk(req, chunk, len(chunk) == len(req.pending)))
        self._fit(plan)
        return plan

    def postprocess(self, plan: Plan, logits: list[torch.Tensor],
                    samples: dict[BatchRequest, Sample | Exception]) -> None:
        """Advance the planned requests by the StepExecutor's logits (of a chunk's last token) and samples."""
        self.steps += bool(plan.chunks)  # a given Plan (first tokens, no forward) belongs to the step after it
        for req, _ in plan.given:
            self._deliver(req, samples[req])
        for (req, tokens, ends), out in zip(plan.chunks, logits):
            req.pending = req.pending[len(tokens):]
            if not ends:
                continue  # still prefilling
            if req.gen.timings.prefill_ms == 0.0:
                req.gen.timings.prefill_ms = req.state.ms()
            if req.scorer is not None:
                req.gen.prompt_logprobs, req.scorer = req.scorer.rows, None
            if not req.gen.token_ids:
                self._prefilled(req, out)
            self._deliver(req, samples[req])

    def _waiting_on(self, shared: SharedPrompt, but: BatchRequest | None = None) -> int:
        return sum(r.shared is shared and r is not but for r in self.waiting)

    def _kept(self) -> list[SharedPrompt]:
        """The shared prompts whose KV is kept for waiting members, each once."""
        return list({id(s): s for s in (r.shared for r in self.waiting) if s and s.kept is not None}.values())

    def _kv_tokens(self) -> int:
        """KV tokens the batch holds: running requests' own (not prefix-cache blocks read in place), and shared kept."""
        return (sum(r.cache.own_tokens for r in self.running if r.cache is not None)
                + sum(s.kept.own_tokens for s in self._kept()))

    def _over_budget(self, new_tokens: int) -> bool:  # past the token cap
        return self._kv_budget is not None and self._kv_tokens() + new_tokens > self._kv_budget

    def _admit(self, plan: Plan) -> None:
        left = self.prefill_budget - sum(len(r.pending) for r in self.running if len(r.pending) > 1)  # to start
        for req in list(self.waiting):
            if len(self.running) >= self.max_running or self.full and self.running:
                break
            shared = req.shared
            if shared is not None and shared.waits(req):
                continue  # another member is still prefilling their prompt
            cost = shared.start_cost(req, self._waiting_on(shared, req)) if shared is not None else None
            if cost is None and self.running and left <= 0:
                continue  # no prompt starts in this step
            need = len(req.pending) + 1 if cost is None else cost
            if self.running and self._over_budget(need + sum(len(r.pending) for r in self.running)):
                break  # (what the running requests have still to run takes room too)
            self.waiting.remove(req)
            if first := req.preemptions == 0:  # time from now on (TTFT excludes the queue wait: queue_ms)
                now = time.perf_counter()
                req.gen.timings.queue_ms += (now - req.state.t0) * 1000.0
                req.state.t0 = now
            known = req.gen.prompt_ids + req.gen.token_ids
            try:
                if cost is not None:  # (a copy of the kept KV, from the pool)
                    logits = shared.start(req, self._waiting_on(shared))
                else:
                    cache, cached, req.handle = self.engine.open_cache(req.gen, known, first)
            except Exception as exc:  # e.g. a skill block that fails to load: this request alone fails
                if isinstance(exc, PoolExhausted) and self.running:  # no block spare: it waits for the others'
                    self.waiting.appendleft(req)
                    break
                self._finish(req, "error", exc)
                continue
            if cost is not None:  # it starts from the kept KV's copy: no token to run, its first drawn from logits
                plan.given.append((req, logits))
                req.shared, cache, cached = None, req.cache, len(known)
            req.cache, req.pending, req.admitted_at = cache, known[cached:], self.steps
            left -= len(req.pending)
            if scores_prompt(req.gen):  # its prefill chunks' logits become prompt logprobs, chunk by chunk
                req.scorer = PromptScorer(known, req.gen.params.prompt_logprobs)
            self.running.append(req)

    def _fit(self, plan: Plan) -> None:
        """Make the step fit: its tokens within a token cap, then each chunk's blocks taken from the pool before the
        forward, oldest request first; room is made where they do not fit (_make_room), and one too big alone fails."""
        while self._over_budget(plan.tokens) and self._make_room(plan):  # (chunks leave the plan at the end)
            pass
        for chunk in plan.chunks:
            while (req := chunk.req) in self.running:
                try:
                    req.cache.reserve(req.cache.offset + len(chunk.tokens))
                    break
                except PoolExhausted as exc:
                    self.full = True  # no one is admitted until a request leaves
                    if not self._make_room(plan):  # it does not fit alone
                        need = req.cache.offset + len(chunk.tokens)
                        self.running.remove(req)
                        self._finish(req, "error", PoolExhausted(f"this request needs KV for at least {need} tokens, "
                                                                  f"more than it can get alone: {exc}"))
        plan.chunks = [c for c in plan.chunks if c.req in self.running]

    def _make_room(self, plan: Plan) -> bool:
        """Drop the KV a shared prompt keeps (its members prefill on their own), else preempt the newest request."""
        if kept := self._kept():
            kept[0].release()
        elif len(self.running) > 1:
            self._preempt_newest(plan)
        else:
            return False
        return True

    def _preempt_newest(self, plan: Plan) -> None:
        """Drop the newest (last admitted) running request's KV; it re-queues at the front, to be recomputed."""
        victim = self.running.pop()
        self._release(victim)
        victim.pending = victim.gen.prompt_ids + victim.gen.token_ids
        victim.preemptions += 1
        victim.scorer = None  # a prompt being scored is scored again from its start
        self.preemptions += 1
        self.waiting.appendleft(victim)
        plan.preempted.append(victim)

    def _prefilled(self, req: BatchRequest, logits: torch.Tensor) -> None:
        """req's prompt is in its cache: publish it to the prefix cache and keep it for members waiting on it."""
        self.engine.publish(req.gen.prompt_ids, req.cache, req.handle)
        shared, req.shared = req.shared, None
        if shared is not None:
            try:
                shared.prefilled(req, logits, self._waiting_on(shared))
            except PoolExhausted:  # no block for the copy: the others prefill on their own
                shared.release()
            if shared.kept is not None and self._over_budget(0):  # no room: the others prefill on their own
                shared.release()

    def _deliver(self, req: BatchRequest, sample: Sample | Exception) -> None:
        """Take req's next token; it leaves the batch when done, or when its sampler or on_event raised."""
        try:
            if isinstance(sample, Exception):
                raise sample
            event = req.state.accept(None, sample)
            if req.on_event is not None:
                req.on_event(event)
        except Exception as exc:
            self.running.remove(req)
            self._finish(req, "error", exc)
            return
        if req.gen.finish_reason:
            self.running.remove(req)
            self._finish(req)
        else:
            req.pending = [event.token_id]

    def _release(self, req: BatchRequest) -> None:
        try:
            self.engine.close_cache(req.gen.prompt_ids + req.gen.token_ids, req.cache, req.handle)
        finally:
            req.cache, req.handle = None, None

    def _finish(self, req: BatchRequest, reason: str | None = None, error: BaseException | None = None) -> None:
        self.full = False  # (its blocks go back)
        if reason and not req.gen.finish_reason:
            req.gen.finish_reason = reason
        if req.shared is not None:
            req.shared.leave(req, self._waiting_on(req.shared, req))
            req.shared = None
        try:
            self._release(req)
        finally:
            if req.on_finish is not None:
                req.on_finish(req.gen, error)
