"""The n choices of one prompt: their seeds, their order, and the Fork through which they share its prefill.

A Fork is the scheduler's SharedPrompt for requests with the same prompt ids: the first (its leader) prefills the
prompt; the others wait, then each starts from a copy of its prompt KV (Engine.fork_cache: on the C++ CPU path with
a prefix cache, one that reads the prompt's cached blocks in place; the last takes the copy itself) and draws its
first token from the same last-token logits with its own sampler. If the first ends before its prefill does, the
others prefill on their own (whichever ends its prefill while others wait leads from then on). The copy counts
against the KV budget; under KV pressure it is dropped before any running request is preempted, and the others
prefill on their own (from the prefix cache, where the first published the prompt).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from kvtool.cache.kv import KVCache
from kvtool.config import SamplingParams
from kvtool.engine.plan import BatchRequest, SharedPrompt


def choice_seed(seed: int | None, i: int) -> int | None:
    """Choice i of a seeded request draws with seed + i (wrapped into torch's seed range)."""
    return None if seed is None else (seed + i if seed + i < 2**64 else seed + i - 2**64)


def choices(prompts: list[list[int]], params: list[SamplingParams], n: int):
    """(ids, params, fork) of choice i of prompt p, in the order p * n + i: choice i seeded seed + i, the
    choices of one prompt sharing a Fork (none for a single choice)."""
    for ids, p in zip(prompts, params):
        fork = Fork() if n > 1 else None
        for i in range(n):
            yield ids, (replace(p, seed=choice_seed(p.seed, i)) if i else p), fork


class Fork(SharedPrompt):
    """A prompt shared by sibling requests: its KV (`cache`) and last-token logits once one has prefilled it."""

    def __init__(self):
        self.leader: BatchRequest | None = None  # the member whose prefill the others start from
        self.cache: KVCache | None = None  # the copy of the prompt's KV for the members waiting
        self.logits: torch.Tensor | None = None  # the prompt's last-token logits: their first tokens draw from them
        self.handle: object = None  # the copy's hold on the prefix cache's blocks it reads (PrefixHook.fork)
        self.abandoned = False  # the leader ended before its prefill did: the others prefill on their own
        self.engine = None  # the kvtool.engine.engine.Engine the members run on

    @property
    def kept(self) -> KVCache | None:
        return self.cache

    def join(self, req: BatchRequest, engine) -> None:
        if self.leader is None:
            self.leader = req
        elif self.leader.gen.prompt_ids != req.gen.prompt_ids:
            raise ValueError("requests that share a fork must have the same prompt ids")
        self.engine = engine

    def waits(self, req: BatchRequest) -> bool:
        return self.leader is not req and self.cache is None and not self.abandoned

    def start_cost(self, req: BatchRequest, waiting: int) -> int | None:
        if self.cache is None:
            return None
        return self.cache.own_tokens + 1 if waiting else 1  # a copy while others wait; the last takes it

    def start(self, req: BatchRequest, waiting: int) -> torch.Tensor:
        leader, logits, timings = self.leader, self.logits, req.gen.timings
        # TTFT counts from when the shared prefill started; waiting for it is not queueing
        timings.queue_ms, req.state.t0 = leader.gen.timings.queue_ms, leader.state.t0
        if waiting:
            req.cache, req.handle = self.engine.fork_cache(self.cache, req.gen.prompt_ids)
        else:
            req.cache, req.handle = self.cache, self.handle
            self.cache = self.logits = self.handle = None
        timings.account(len(req.gen.prompt_ids), len(req.gen.prompt_ids), None)
        timings.prefill_ms, req.gen.prompt_logprobs = leader.gen.timings.prefill_ms, leader.gen.prompt_logprobs
        return logits

    def prefilled(self, req: BatchRequest, logits: torch.Tensor, waiting: int) -> None:
        if waiting:  # (req leads now, if the first left before its prefill)
            self.leader, self.logits = req, logits.detach().clone()
            self.cache, self.handle = self.engine.fork_cache(req.cache, req.gen.prompt_ids)

    def release(self) -> None:
        self._drop()
        self.abandoned = True

    def leave(self, req: BatchRequest, waiting: int) -> None:
        if self.leader is req and self.cache is None:
            self.abandoned = True  # ended before its prefill did
        elif not waiting:
            self._drop()  # the last sibling left without using the copy

    def _drop(self) -> None:
        if self.handle is not None:  # ends the copy's hold (the first cached the prompt already)
            self.engine.close_cache([], self.cache, self.handle)
        self.cache = self.logits = self.handle = None
