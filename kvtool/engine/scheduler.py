"""Continuous batching: many requests share each forward.

Every step packs, into one runner.run(ForwardPlan) call, one decode token of each running request plus prefill chunks
of admitted requests within `prefill_budget` tokens, so a long prompt is prefilled over several steps without
stalling the streams already running. Under KV pressure the most recently admitted request is preempted: its KV is
dropped and it is re-queued at the front to be recomputed later (its token stream simply continues).

Every request that samples in a step and has no seed is sampled together with the others
(kvtool.engine.batch_sampling): one pass over their stacked logits, each row with its own parameters, and one host
read for all tokens and logprobs. A seeded request draws from its own generator, alone, so its output repeats
exactly as in a single stream. `host_s` counts the time steps spend outside the forward and that read (scheduling,
detokenizing, callbacks).

A fault while sampling one request (on_event or the sampler raising) ends that request alone, with finish_reason
"error" and the exception passed to its on_finish callback. With a prefix cache, a request's prompt KV goes into it
as soon as its prefill ends (publish), so requests that arrive while it still decodes reuse that prompt; the rest is
cached when it finishes. A request is admitted (a lookup) only in a step whose budget starts its prompt: requests
arriving together read what the first published. The n choices of one prompt share its prefill through a Fork
(kvtool.engine.forks).
"""

from __future__ import annotations

import time
import warnings
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Callable

import torch

from kvtool.cache.kv import KVCache
from kvtool.config import SamplingParams, as_sampling_params, is_whole
from kvtool.engine.batch_sampling import batchable, sample_rows
from kvtool.engine.forks import Fork, choices
from kvtool.engine.output import Generation, OutputState, TokenEvent, scores_prompt
from kvtool.engine.scoring import SCORE_CHUNK, PromptScorer
from kvtool.errors import InvalidParameterError, PrefixCacheWarning
from kvtool.ids import as_token_ids
from kvtool.models.layers import ForwardPlan


@dataclass(eq=False)  # a request is an entity: membership tests and remove() go by identity
class BatchRequest:
    gen: Generation
    state: OutputState
    on_event: Callable[[TokenEvent], None] | None
    on_finish: Callable[[Generation, BaseException | None], None] | None = None
    pending: list[int] = field(default_factory=list)  # tokens whose KV is not yet in the cache
    cache: KVCache | None = None
    handle: object = None
    admitted_at: int = -1
    preemptions: int = 0
    fork: Fork | None = None  # until admitted: the prompt it shares with sibling requests
    scorer: PromptScorer | None = None  # while a prompt_logprobs request prefills: its rows so far


class BatchScheduler:
    def __init__(self, engine, max_running: int = 16, prefill_budget: int = 256,
                 kv_budget_tokens: int | None = None):
        for name, value in (("max_running", max_running), ("prefill_budget", prefill_budget),
                            ("kv_budget_tokens", 1 if kv_budget_tokens is None else kv_budget_tokens)):
            if not is_whole(value, 1):
                raise InvalidParameterError(f"{name} must be an integer >= 1, got {value!r}")
        self.engine, self.max_running, self.prefill_budget = engine, max_running, prefill_budget
        self.kv_budget_tokens = kv_budget_tokens
        self.waiting: deque[BatchRequest] = deque()
        self.running: list[BatchRequest] = []
        self.steps = 0
        self.preemptions = 0  # running requests whose KV was dropped for room (recomputed when readmitted)
        self.kv_in_use = 0  # _kv_tokens() after the last step, for readers on other threads
        self.host_s = 0.0  # time steps spent outside the forward and the token read (scheduling, detokenizing)

    def submit(self, prompt_ids: list[int], params: SamplingParams | None = None, skip_special_tokens: bool = True,
               on_event: Callable[[TokenEvent], None] | None = None,
               on_finish: Callable[[Generation, BaseException | None], None] | None = None,
               fork: Fork | None = None) -> Generation:
        """Validate and queue a request (raises KvtoolError for bad input); returns its Generation."""
        gen, max_tokens = self.engine.new_generation(prompt_ids, params)
        self.add(gen, max_tokens, skip_special_tokens, on_event, on_finish, fork)
        return gen

    def add(self, gen: Generation, max_tokens: int, skip_special_tokens: bool = True,
            on_event: Callable[[TokenEvent], None] | None = None,
            on_finish: Callable[[Generation, BaseException | None], None] | None = None,
            fork: Fork | None = None) -> None:
        """Queue a Generation already validated by Engine.new_generation(). Requests given the same `fork`
        (same prompt ids) prefill that prompt once: the first added prefills it for the others."""
        state = OutputState(self.engine, gen, max_tokens, skip_special_tokens, time.perf_counter())
        req = BatchRequest(gen, state, on_event, on_finish, pending=list(gen.prompt_ids), fork=fork)
        if fork is not None and fork.leader is None:
            fork.leader = req
        elif fork is not None and fork.leader.gen.prompt_ids != gen.prompt_ids:
            raise ValueError("requests that share a fork must have the same prompt ids")
        self.waiting.append(req)

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

    def _kv_tokens(self) -> int:
        """Tokens of KV the batch holds: the running requests' own (not the prefix cache's blocks a hit reads in
        place: that cache holds them), and the fork copies waiting for siblings."""
        return (sum(r.cache.own_tokens for r in self.running if r.cache is not None)
                + sum(fork.cache.own_tokens for fork in self._held_forks()))

    def _held_forks(self) -> list[Fork]:
        """The forks whose prompt KV copy waits for siblings, each once."""
        return list({id(f): f for f in (r.fork for r in self.waiting) if f and f.cache is not None}.values())

    def _over_budget(self, new_tokens: int) -> bool:
        return self.kv_budget_tokens is not None and self._kv_tokens() + new_tokens > self.kv_budget_tokens

    def _admit(self) -> None:
        left = self.prefill_budget - sum(len(r.pending) for r in self.running if len(r.pending) > 1)  # to start
        for req in list(self.waiting):
            if len(self.running) >= self.max_running:
                break
            fork = req.fork
            waits = fork is not None and fork.leader is not req and fork.cache is None and not fork.abandoned
            if waits or ((fork is None or fork.cache is None) and self.running and left <= 0):
                continue  # its sibling is still prefilling their prompt, or no prompt starts in this step
            need = len(req.pending) + 1
            if fork is not None and fork.cache is not None:  # a copy of the fork's KV; the last sibling takes it
                last = not any(r.fork is fork and r is not req for r in self.waiting)
                need = 1 if last else fork.cache.own_tokens + 1
            if self.running and self._over_budget(need + sum(len(r.pending) for r in self.running)):
                break  # (what the running requests have still to run takes room too)
            self.waiting.remove(req)
            if first := req.preemptions == 0:  # time from now on (TTFT excludes the queue wait: queue_ms)
                now = time.perf_counter()
                req.gen.timings.queue_ms += (now - req.state.t0) * 1000.0
                req.state.t0 = now
            if fork is not None and fork.cache is not None:
                self._admit_sibling(req, fork)
                continue
            known = req.gen.prompt_ids + req.gen.token_ids
            try:
                cache, cached, req.handle = self.engine.open_cache(req.gen, known, first)
            except Exception as exc:  # e.g. a skill block that fails to load: this request alone fails
                self._finish(req, "error", exc)
                continue
            req.cache, req.pending, req.admitted_at = cache, known[cached:], self.steps
            left -= len(req.pending)
            if scores_prompt(req.gen):  # its prefill chunks' logits become prompt logprobs, chunk by chunk
                req.scorer = PromptScorer(known, req.gen.params.prompt_logprobs)
            self.running.append(req)

    def _admit_sibling(self, req: BatchRequest, fork: Fork) -> None:
        """Start req from its fork's prompt KV (a copy, or the last one itself) and draw its first token."""
        leader, req.fork = fork.leader, None
        # TTFT counts from when the shared prefill started; waiting for it is not queueing
        req.gen.timings.queue_ms, req.state.t0 = leader.gen.timings.queue_ms, leader.state.t0
        last = not any(r.fork is fork for r in self.waiting)
        req.cache, req.handle = (fork.cache, fork.handle) if last else self._fork_copy(fork.cache, req.gen.prompt_ids)
        logits = fork.logits
        if last:
            fork.cache = fork.logits = fork.handle = None
        prompt = len(req.gen.prompt_ids)
        req.gen.timings.account(prompt, prompt, None)
        req.gen.timings.prefill_ms = leader.gen.timings.prefill_ms
        req.gen.prompt_logprobs = leader.gen.prompt_logprobs
        req.pending, req.admitted_at = [], self.steps
        self.running.append(req)
        self._deliver(req, logits, None)

    def _prefilled(self, req: BatchRequest, logits: torch.Tensor) -> None:
        """req's prompt is in its cache (logits: of its last token): share it with the prefix cache and, for a
        fork's leader, keep a copy for the siblings."""
        if self.engine.prefix_cache is not None:
            self.engine.prefix_cache.publish(req.handle, req.gen.prompt_ids[: req.cache.offset], req.cache)
        if req.fork is not None:
            fork, req.fork = req.fork, None
            if any(r.fork is fork for r in self.waiting):  # (req leads now, if the first left before its prefill)
                fork.leader, fork.logits = req, logits.detach().clone()
                fork.cache, fork.handle = self._fork_copy(req.cache, req.gen.prompt_ids)
                if self._over_budget(0):  # no room for the copy: the others prefill on their own
                    self._drop_fork(fork)
                    fork.abandoned = True

    def _fork_copy(self, cache: KVCache, prompt_ids: list[int]) -> tuple[KVCache, object]:
        """(a copy of a fork's prompt KV, its hold): the hook's fork (PrefixHook.fork; PrefixCache's reads the
        prompt's cached blocks in place on the C++ CPU path), else KVCache.fork (over its own full blocks where it
        is paged)."""
        hook = self.engine.prefix_cache
        return hook.fork(cache, prompt_ids, self.engine.runner) if hook is not None else (cache.fork(), None)

    def _drop_fork(self, fork: Fork) -> None:
        if fork.handle is not None:  # ends the copy's hold (the first cached the prompt already)
            self.engine.prefix_cache.commit(fork.handle, [], fork.cache)
        fork.cache = fork.logits = fork.handle = None

    def _deliver(self, req: BatchRequest, logits: torch.Tensor | None, sample) -> None:
        """Accept req's next token (from logits, or the batched sample); it leaves the batch when done."""
        try:
            event = req.state.accept(logits, sample)
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

    def _preempt_for(self, new_tokens: int) -> bool:
        """Drop fork copies, then the newest requests' KV, until this step's tokens fit the KV budget; whether
        any running request was dropped."""
        for fork in self._held_forks():  # first the copies siblings wait for: they can prefill on their own
            if not self._over_budget(new_tokens):
                break
            self._drop_fork(fork)
            fork.abandoned = True
        dropped = False
        while len(self.running) > 1 and self._over_budget(new_tokens):
            victim = max(self.running, key=lambda r: r.admitted_at)
            self.running.remove(victim)
            self._release(victim)
            victim.pending = victim.gen.prompt_ids + victim.gen.token_ids
            victim.preemptions += 1
            victim.scorer = None  # a prompt being scored is scored again from its start
            self.preemptions += 1
            self.waiting.appendleft(victim)
            dropped = True
        return dropped

    def _release(self, req: BatchRequest) -> None:
        try:
            if req.cache is not None and self.engine.prefix_cache is not None:
                known = req.gen.prompt_ids + req.gen.token_ids
                self.engine.prefix_cache.commit(req.handle, known[: req.cache.offset], req.cache)
        except Exception as exc:  # handing KV back to the cache must never fail the request (or the batch)
            warnings.warn(PrefixCacheWarning(f"prefix cache: taking back a finished request's KV failed "
                                             f"({type(exc).__name__}: {exc}); it is not cached"), stacklevel=2)
        finally:
            req.cache, req.handle = None, None

    def _finish(self, req: BatchRequest, reason: str | None = None, error: BaseException | None = None) -> None:
        if reason and not req.gen.finish_reason:
            req.gen.finish_reason = reason
        fork = req.fork
        if fork is not None and fork.leader is req and fork.cache is None:
            fork.abandoned = True  # ended before its prefill did
        elif fork is not None and not any(r.fork is fork and r is not req for r in self.waiting):
            self._drop_fork(fork)  # the last sibling left without using the copy
        req.fork = None
        try:
            self._release(req)
        finally:
            if req.on_finish is not None:
                req.on_finish(req.gen, error)

    def step(self) -> int:
        """One batched forward; returns the number of tokens it processed."""
        t_start = time.perf_counter()
        self._admit()
        if not self.running:
            self.kv_in_use = self._kv_tokens()
            return 0
        budget = self.prefill_budget
        plan: list[tuple[BatchRequest, list[int]]] = []
        for req in sorted(self.running, key=lambda r: r.admitted_at):
            if len(req.pending) == 1:  # decoding
                plan.append((req, req.pending))
            elif budget > 0:
                chunk = req.pending[: min(budget, SCORE_CHUNK) if req.scorer is not None else budget]
                budget -= len(chunk)
                plan.append((req, chunk))
        new_tokens = sum(len(c) for _, c in plan)
        if self._preempt_for(new_tokens):
            plan = [(r, c) for r, c in plan if r in self.running]
        t_plan = time.perf_counter()
        logits = self._forward(plan)
        self.steps += 1
        for j, (req, _) in enumerate(plan):
            if req.scorer is not None:  # every row of a scored chunk: reduced now, the last one kept
                req.scorer.add(logits[j])
                logits[j] = logits[j][-1:]
        samples = self._sample(plan, logits)  # reads the tokens back: the step's host sync
        t_read = time.perf_counter()
        for j, ((req, chunk), out) in enumerate(zip(plan, logits)):
            req.pending = req.pending[len(chunk):]
            if req.pending:
                continue  # still prefilling
            if req.gen.timings.prefill_ms == 0.0:
                req.gen.timings.prefill_ms = req.state.ms()
            if req.scorer is not None:
                req.gen.prompt_logprobs, req.scorer = req.scorer.rows, None
            if not req.gen.token_ids:
                self._prefilled(req, out)
            self._deliver(req, out, samples.get(j))
        self.kv_in_use = self._kv_tokens()
        self.host_s += (t_plan - t_start) + (time.perf_counter() - t_read)
        return sum(len(c) for _, c in plan)

    @staticmethod
    def _sample(plan: list[tuple[BatchRequest, list[int]]], logits: list[torch.Tensor]) -> dict:
        """{plan index: Sample} for every request sampling now that has no generator of its own: one pass over
        their stacked logits and one host read for all of them (kvtool.engine.batch_sampling). Seeded
        requests sample alone with their own generator, so a seed repeats exactly as in a single stream."""
        now = [j for j, (req, chunk) in enumerate(plan)
               if len(req.pending) == len(chunk) and batchable(req.state.sampler)]
        if not now:
            return {}
        parts = [logits[j].reshape(1, -1) for j in now]
        stacked = torch.cat(parts) if len(parts) > 1 else parts[0]
        return dict(zip(now, sample_rows([plan[j][0].state.sampler for j in now], stacked)))

    def _forward(self, plan: list[tuple[BatchRequest, list[int]]]) -> list[torch.Tensor]:
        """The logits of each planned chunk: its last token's [1, V], or every token's [T, V] for a prompt being
        scored, from one runner.run over the whole step on the engine's choice of forward (EngineConfig.forward)."""
        modes = [("all" if r.scorer is not None else "last") for r, _ in plan]
        step = ForwardPlan([(c, r.cache) for r, c in plan], logits=modes if "all" in modes else "last",
                           path=self.engine.config.forward)
        return self.engine.runner.run(step)

    def run(self) -> None:
        while not self.idle:
            self.step()


def generate_batch(engine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                   n: int = 1, skip_special_tokens: bool = True) -> list[Generation]:
    """Every prompt (token ids) n times through the engine's scheduler, as vLLM's LLM.generate: the finished
    Generations, choice i of prompt p at p * n + i. A list of params gives each prompt its own; a seed s gives
    choice i the seed s + i (it then equals a single run seeded s + i); a prompt's choices prefill it once."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise InvalidParameterError(f"prompts must be a list of prompts (token id lists); got {type(prompts).__name__}")
    prompts = [as_token_ids(ids, f"prompts[{i}]") for i, ids in enumerate(prompts)]
    per_prompt = [as_sampling_params(p) for p in params] if isinstance(params, list) else \
        [as_sampling_params(params)] * len(prompts)
    if len(per_prompt) != len(prompts):
        raise InvalidParameterError(f"{len(per_prompt)} SamplingParams for {len(prompts)} prompts; give one, or "
                                    "one per prompt")
    if not isinstance(n, int) or n < 1:
        raise InvalidParameterError(f"n must be an integer >= 1, got {n!r}")
    gens, sched = [], engine.scheduler
    try:  # all are validated before any is queued
        checked = [(*engine.new_generation(ids, p), fork) for ids, p, fork in choices(prompts, per_prompt, n)]
        for gen, max_tokens, fork in checked:
            sched.add(gen, max_tokens, skip_special_tokens, fork=fork)
            gens.append(gen)
        while any(g.finish_reason is None for g in gens):
            sched.step()
    finally:  # interrupted: what it queued leaves the scheduler
        for gen in gens:
            if gen.finish_reason is None:
                sched.cancel(gen)
    return gens

