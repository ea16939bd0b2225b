"""What a step is made of: a batch's requests, the chunks of their tokens a step runs (a Plan: BatchScheduler makes it,
the StepExecutor runs it), and SharedPrompt, the prompt the n choices of a request prefill once (forks.Fork)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch

from kvtool.cache.kv import KVCache
from kvtool.engine.output import Generation, OutputState, TokenEvent
from kvtool.engine.scoring import PromptScorer


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
    shared: SharedPrompt | None = None  # until its prompt is in its cache: the prompt it shares with other requests
    scorer: PromptScorer | None = None  # while a prompt_logprobs request prefills: its rows so far


class Chunk(NamedTuple):
    req: BatchRequest
    tokens: list[int]  # the next of its pending tokens, to run in this step
    samples: bool  # they end its pending tokens: the last one's logits draw its next token


@dataclass
class Plan:
    """One step's work. chunks: the requests that run tokens, oldest admitted first (a decode: one token that
    samples). given: requests that start from a shared prompt's logits and draw their first token from them, with
    no forward (a Plan of those alone). preempted: running requests whose KV was dropped for room."""
    chunks: list[Chunk] = field(default_factory=list)
    given: list[tuple[BatchRequest, torch.Tensor]] = field(default_factory=list)
    preempted: list[BatchRequest] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(len(c.tokens) for c in self.chunks)


class SharedPrompt(ABC):
    """One prompt its members (the n choices of a prompt) prefill once. `waiting`: how many other members the waiting
    queue holds. `kept`: the prompt's KV kept for the members not started (it counts against the KV budget)."""
    kept: KVCache | None

    @abstractmethod
    def join(self, req: BatchRequest, engine) -> None:
        """req shares the prompt (ValueError where its prompt ids differ from the first member's)."""

    @abstractmethod
    def waits(self, req: BatchRequest) -> bool:
        """Whether req waits for another member's prefill."""

    @abstractmethod
    def start_cost(self, req: BatchRequest, waiting: int) -> int | None:
        """KV tokens that starting req from the kept KV takes; None where req prefills the prompt itself."""

    @abstractmethod
    def start(self, req: BatchRequest, waiting: int) -> torch.Tensor:
        """Give req the kept KV (its cache and handle) and the prompt's timings; the logits its first token draws from."""

    @abstractmethod
    def prefilled(self, req: BatchRequest, logits: torch.Tensor, waiting: int) -> None:
        """req's prompt is in its cache (logits: of its last token): keep them for the members waiting."""

    @abstractmethod
    def release(self) -> None:
        """Drop the kept KV: the members not started prefill the prompt themselves."""

    @abstractmethod
    def leave(self, req: BatchRequest, waiting: int) -> None:
        """req ends before it started from the kept KV."""
