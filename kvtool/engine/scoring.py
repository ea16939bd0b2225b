"""Prompt logprobs: how likely the model finds each prompt token, given the tokens before it.

A request with SamplingParams.prompt_logprobs = k is prefilled in full (no prefix-cache hit: a cached
token has no logits) in chunks of at most SCORE_CHUNK tokens whose logits are reduced right away, so
memory stays at chunk x vocabulary: a PromptScorer fed by the scheduler's prefill chunks. Each row is a
PromptLogprob; the first token has none (nothing precedes it). The last chunk's last row is what the first
generated token is sampled from.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

SCORE_CHUNK = 512  # prompt tokens per forward while scoring: [chunk, vocab] fp32 logits at a time


@dataclass
class PromptLogprob:
    token_id: int
    logprob: float | None  # None for the first prompt token
    rank: int | None = None  # 1 = the model's most likely token at that position
    top: list[tuple[int, float]] = field(default_factory=list)  # the k most likely (id, logprob)


class PromptScorer:
    """Prompt logprobs chunk by chunk, as the prompt is prefilled: add() each chunk's logits (all rows, in
    order); `rows` is complete once every prompt token has been added. The batch scheduler scores this way,
    inside its chunked prefill, so a scored prompt does not stall the streams running beside it."""

    def __init__(self, ids: list[int], top: int):
        self.ids, self.top = ids, top
        self.rows = [PromptLogprob(ids[0], None)]
        self.added = 0  # prompt tokens whose logits came in

    @property
    def done(self) -> bool:
        return self.added >= len(self.ids)

    @torch.inference_mode()
    def add(self, logits: torch.Tensor) -> None:
        """logits [t, V] of the next t prompt tokens: row r predicts the token after the (added + r)-th."""
        start, t = self.added, logits.shape[0]
        targets = self.ids[start + 1 : start + t + 1]
        self.added += t
        if not targets:
            return
        logp = torch.log_softmax(logits[: len(targets)].float(), dim=-1)
        want = torch.tensor(targets, device=logp.device)[:, None]
        chosen = logp.gather(1, want)
        ranks = (logp > chosen).sum(1) + 1
        best = logp.topk(self.top, dim=-1) if self.top else None
        for r, (tok, lp, rank) in enumerate(zip(targets, chosen[:, 0].tolist(), ranks.tolist())):
            alts = list(zip(best.indices[r].tolist(), best.values[r].tolist())) if best is not None else []
            self.rows.append(PromptLogprob(tok, lp, rank, alts))

