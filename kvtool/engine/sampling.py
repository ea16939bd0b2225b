"""Logits -> next token: penalties, logit bias, allowed tokens, min_tokens, temperature, top-k/top-p/min-p,
seeded sampling.

Order as in vLLM: penalties, logit_bias, allowed_token_ids, the min_tokens hold on stop tokens, the
structured-output mask (kvtool.engine.constraint), temperature, then the truncations, then sampling.
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
    """Samples on the device the logits live on: the only host sync per token reads the result
    (token id, and the logprobs when asked for) in one transfer."""

    def __init__(self, params: SamplingParams, vocab_size: int, prompt_ids: list[int], device: torch.device):
        self.p = params = params.with_defaults()  # unset after the engine applied its model's: the plain ones
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.generator = None
        if params.seed is not None:
            self.generator = torch.Generator(device=self.device).manual_seed(params.seed)
        # seen (prompt + output, for repetition_penalty) and counts (output, presence/frequency), kept only when used
        self.track = params.repetition_penalty != 1.0 or bool(params.presence_penalty or params.frequency_penalty)
        self.seen_any = False  # known on the host, so the penalty never syncs to ask
        self.constraint = None  # a Constraint in a structured mode (set by the engine): which tokens may come next
        self.seen = self.counts = None
        self.produced = 0  # tokens observed so far: min_tokens holds the stop tokens back until it is reached
        self.held: torch.Tensor | None = None  # the stop tokens min_tokens holds back (set by hold())
        self.allowed = None  # allowed_token_ids: the only tokens that may be drawn
        if params.allowed_token_ids is not None:
            ids = sorted({t for t in params.allowed_token_ids if t < vocab_size})
            self.allowed = torch.tensor(ids, dtype=torch.long, device=self.device)
        self.bias = None  # (token ids, biases) of logit_bias
        if params.logit_bias:
            ids = list(params.logit_bias)
            self.bias = (torch.tensor(ids, dtype=torch.long, device=self.device),
                         torch.tensor([float(params.logit_bias[t]) for t in ids], device=self.device))
        if self.track:
            self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=self.device)
            self.counts = torch.zeros(vocab_size, dtype=torch.float32, device=self.device)
            ids = [t for t in prompt_ids if t < vocab_size] if params.repetition_penalty != 1.0 else []
            if ids:
                self.seen[torch.tensor(ids, dtype=torch.long, device=self.device)] = True
                self.seen_any = True

    def hold(self, stop_ids) -> None:
        """Keep these tokens from being drawn until params.min_tokens tokens have been observed."""
        ids = sorted(t for t in stop_ids if t < self.vocab_size)
        if self.p.min_tokens and ids:
            self.held = torch.tensor(ids, dtype=torch.long, device=self.device)

    @property
    def adjusts(self) -> bool:
        """Whether _adjust changes the logits this step (penalties, a logit bias, allowed tokens, held stops)."""
        return (self.track or self.bias is not None or self.allowed is not None or self._holding
                or self.constraint is not None)

    @property
    def _holding(self) -> bool:
        return self.held is not None and self.produced < self.p.min_tokens

    def observe(self, token: int) -> None:
        self.produced += 1
        if self.constraint is not None:
            self.constraint.accept(token)
        if self.track and token < self.vocab_size:
            self.seen[token] = True
            self.counts[token] += 1
            self.seen_any = True

    def __call__(self, logits: torch.Tensor) -> Sample:
        """logits [V] (or [1, V]) fp32 -> Sample, computed on the sampler's device."""
        logits = logits.reshape(-1)[: self.vocab_size].float().to(self.device)
        x = self._adjust(logits)
        if self.p.greedy:
            token = torch.argmax(x)
        else:
            x = self._truncate(x / self.p.temperature)
            token = torch.multinomial(torch.softmax(x, dim=-1), 1, generator=self.generator)[0]
        if self.p.logprobs is None:
            return Sample(int(token))
        raw = torch.log_softmax(logits, dim=-1)
        parts = [token.reshape(1).float(), raw[token].reshape(1)]
        if self.p.logprobs > 0:
            values, ids = torch.topk(raw, self.p.logprobs)
            parts += [values, ids.float()]  # ids < 2^24: exact in fp32
        out = torch.cat(parts).tolist()
        k = self.p.logprobs
        top = [(int(i), v) for i, v in zip(out[2 + k :], out[2 : 2 + k])] if k > 0 else None
        return Sample(int(out[0]), out[1], top)

    def _adjust(self, x: torch.Tensor, constrain: bool = True) -> torch.Tensor:
        """Penalties, then logit_bias, allowed_token_ids, the min_tokens hold and the structured-output mask (unless
        constrain is False: the batched sampler masks many rows at once): what every mode draws from."""
        p = self.p
        if p.repetition_penalty != 1.0 and self.seen_any:
            x = torch.where(self.seen, torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty), x)
        if p.presence_penalty or p.frequency_penalty:
            x = x - p.frequency_penalty * self.counts - p.presence_penalty * (self.counts > 0).float()
        if self.bias is not None:
            x = x.index_add(0, self.bias[0], self.bias[1])
        if self.allowed is not None:
            x = torch.full_like(x, float("-inf")).index_copy(0, self.allowed, x.index_select(0, self.allowed))
        if self._holding:
            x = x.index_fill(0, self.held, float("-inf"))
        if constrain and self.constraint is not None:
            x = self.constraint.mask(x)
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
            x = x.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))  # no host sync
        return x
