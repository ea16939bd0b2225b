"""Logits -> next token: penalties, temperature, top-k/top-p/min-p, seeded sampling.

Order as in vLLM: penalties, temperature, then the truncations, then sampling.
Logprobs are reported from the raw model distribution (before any processing).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtool.config import SamplingParams


@dataclass
class Sample:
    token: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None


class Sampler:
    def __init__(self, params: SamplingParams, vocab_size: int, prompt_ids: list[int], device: torch.device):
        self.p = params
        self.vocab_size = vocab_size
        self.generator = None
        if params.seed is not None:
            self.generator = torch.Generator(device="cpu").manual_seed(params.seed)
        self.seen = torch.zeros(vocab_size, dtype=torch.bool)  # prompt + output, for repetition_penalty
        self.counts = torch.zeros(vocab_size, dtype=torch.float32)  # output only, for presence/frequency
        if prompt_ids and params.repetition_penalty != 1.0:
            self.seen[torch.tensor([t for t in prompt_ids if t < vocab_size], dtype=torch.long)] = True

    def observe(self, token: int) -> None:
        if token < self.vocab_size:
            self.seen[token] = True
            self.counts[token] += 1

    def __call__(self, logits: torch.Tensor) -> Sample:
        """logits [V] (or [1, V]) fp32 on any device -> Sample."""
        logits = logits.reshape(-1)[: self.vocab_size].float().cpu()
        top = logprob = None
        if self.p.logprobs is not None:
            raw = torch.log_softmax(logits, dim=-1)
        x = self._penalise(logits)
        if self.p.greedy:
            token = int(torch.argmax(x))
        else:
            x = x / self.p.temperature
            x = self._truncate(x)
            probs = torch.softmax(x, dim=-1)
            token = int(torch.multinomial(probs, 1, generator=self.generator))
        if self.p.logprobs is not None:
            logprob = float(raw[token])
            if self.p.logprobs > 0:
                values, ids = torch.topk(raw, self.p.logprobs)
                top = [(int(i), float(v)) for i, v in zip(ids, values)]
        return Sample(token, logprob, top)

    def _penalise(self, x: torch.Tensor) -> torch.Tensor:
        p = self.p
        if p.repetition_penalty != 1.0 and self.seen.any():
            x = x.clone()
            picked = x[self.seen]
            x[self.seen] = torch.where(picked > 0, picked / p.repetition_penalty, picked * p.repetition_penalty)
        if p.presence_penalty or p.frequency_penalty:
            x = x - p.frequency_penalty * self.counts - p.presence_penalty * (self.counts > 0).float()
        return x

    def _truncate(self, x: torch.Tensor) -> torch.Tensor:
        p = self.p
        if p.top_k and p.top_k < x.shape[0]:
            kth = torch.topk(x, p.top_k).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        if p.min_p > 0.0:
            probs = torch.softmax(x, dim=-1)
            x = x.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
        if p.top_p < 1.0:
            sorted_x, order = torch.sort(x, descending=True)
            cum = torch.softmax(sorted_x, dim=-1).cumsum(-1)
            drop = cum - torch.softmax(sorted_x, dim=-1) >= p.top_p  # keep the token that crosses top_p
            x = x.clone()
            x[order[drop]] = float("-inf")
        return x
