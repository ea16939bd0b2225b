"""What a generation yields and holds, shared by Engine.generate() and the batch scheduler.

TokenEvent (one streamed token), Timings, Generation (the streaming result), and the per-request output
side: OutputText (detokenizing, stop handling, timings) and OutputState (kvtool's own sampling on top).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Iterator

import torch

from kvtool.config import SamplingParams
from kvtool.engine.detok import IncrementalDetokenizer, StopStringMatcher, decode_piece
from kvtool.engine.sampling import Sample, Sampler


@dataclass
class TokenEvent:
    index: int  # position in the output
    token_id: int
    piece: str  # this token alone, decoded verbatim (special tokens included)
    text: str  # visible text released by this token (may be "" while held back)
    t_ms: float  # since the request started
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass
class Timings:
    queue_ms: float = 0.0
    ttft_ms: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # served by the prefix cache
    skill_block_tokens: int = 0  # served by skill KV blocks (spliced, not recomputed)
    prefill_tokens: int = 0  # computed for this request (the rest)
    prefill_ms: float = 0.0
    decode_tokens: int = 0
    decode_ms: float = 0.0
    skill_path: str | None = None  # with skill blocks served: composed | prefilled | cached
    skill_path_reason: str | None = None

    @property
    def decode_tokens_per_s(self) -> float:
        return 1000.0 * (self.decode_tokens - 1) / self.decode_ms if self.decode_tokens > 1 and self.decode_ms else 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return 1000.0 * self.prefill_tokens / self.prefill_ms if self.prefill_ms else 0.0

    def account(self, prompt_tokens: int, ready: int, splice=None) -> None:
        """Split the prompt into cached / block / prefilled tokens; `ready` tokens were in the cache at start.

        `splice` is a skill splicer's stats (kvtool.skills.splice.SpliceStats) when one prepared the cache:
        its ready tokens are the prefix hit, the blocks it placed and the gaps it prefilled itself."""
        cached, blocks = ready, 0
        if splice is not None:
            cached = min(splice.prefix_hit_tokens, ready)
            blocks = min(splice.reused_block_tokens, ready - cached)
            self.skill_path, self.skill_path_reason = splice.path, splice.path_reason
        self.prompt_tokens, self.cached_tokens, self.skill_block_tokens = prompt_tokens, cached, blocks
        self.prefill_tokens = prompt_tokens - cached - blocks

    def to_dict(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if v is not None}  # skill_path*: only with skills served
        out["decode_tokens_per_s"] = round(self.decode_tokens_per_s, 2)
        out["prefill_tokens_per_s"] = round(self.prefill_tokens_per_s, 2)
        return out


@dataclass
class Generation:
    """A streaming generation. Iterate for TokenEvents; read the results afterwards."""

    prompt_ids: list[int]
    params: SamplingParams
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # stop | length | abort
    stop_reason: int | str | None = None  # what stopped it: a stop string, a stop_token_ids id; None for end of turn
    timings: Timings = field(default_factory=Timings)
    prompt_logprobs: list | None = None  # [PromptLogprob] per prompt token, when params.prompt_logprobs is set
    _events: Iterator[TokenEvent] | None = None
    _constraint: object = field(default=None, repr=False)  # kvtool.engine.constraint.Constraint, built in validation

    def __iter__(self) -> Iterator[TokenEvent]:
        return self._events

    def close(self) -> None:
        """Stop generating now (client went away); frees the request's KV."""
        if self._events is not None:
            self._events.close()
        if self.finish_reason is None:
            self.finish_reason = "abort"

    def run(self) -> "Generation":
        for _ in self:
            pass
        return self


def scores_prompt(gen: Generation) -> bool:
    """Whether starting gen computes its prompt logprobs (until they are complete: a start that is cut short
    scores again)."""
    return gen.params.prompt_logprobs is not None and gen.prompt_logprobs is None


class OutputText:
    """Per-request output side of any engine: detokenization, stop handling, timings. take() each token the
    engine drew (with its logprob and top alternatives); it updates the Generation and sets finish_reason."""

    def __init__(self, tokenizer, stops: set[int], gen: Generation, max_tokens: int, skip_special_tokens: bool,
                 t0: float):
        self.gen, self.max_tokens, self.t0, self.tokenizer, self.stops = gen, max_tokens, t0, tokenizer, stops
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self.matcher = StopStringMatcher(gen.params.stop, gen.params.include_stop_str_in_output)
        self.t_first: float | None = None

    def ms(self) -> float:
        return (time.perf_counter() - self.t0) * 1000.0

    def take(self, tok: int, logprob: float | None = None, top: list[tuple[int, float]] | None = None) -> TokenEvent:
        gen, tm, matcher = self.gen, self.gen.timings, self.matcher
        i = len(gen.token_ids)
        gen.token_ids.append(tok)
        now = self.ms()
        if self.t_first is None:
            self.t_first = tm.ttft_ms = now
        tm.decode_tokens, tm.decode_ms = i + 1, now - self.t_first
        is_stop = tok in self.stops
        text = "" if is_stop else matcher.feed(self.detok.add(tok), armed=i + 1 >= gen.params.min_tokens)
        if is_stop or matcher.stopped:
            text += matcher.finish() if not matcher.stopped else ""
            gen.finish_reason, gen.stop_reason = "stop", matcher.matched
            if is_stop and tok in gen.params.stop_token_ids:
                gen.stop_reason = tok
                if gen.params.include_stop_str_in_output:
                    text += self.detok.add(tok) + self.detok.flush()
        elif i == self.max_tokens - 1:
            text += matcher.feed(self.detok.flush()) + matcher.finish()
            gen.finish_reason, gen.stop_reason = ("stop" if matcher.stopped else "length"), matcher.matched
        gen.text += text
        return TokenEvent(i, tok, decode_piece(self.tokenizer, tok), text, now, logprob, top)


class OutputState(OutputText):
    """OutputText plus kvtool's own sampling of each next token (engine: the kvtool.engine.engine.Engine)."""

    def __init__(self, engine, gen: Generation, max_tokens: int, skip_special_tokens: bool, t0: float):
        params = gen.params
        super().__init__(engine.model.tokenizer, engine.stop_ids(params), gen, max_tokens, skip_special_tokens, t0)
        self.sampler = Sampler(params, engine.runner.spec.vocab_size, gen.prompt_ids, engine.runner.device)
        self.sampler.hold(self.stops)
        self.sampler.constraint = gen._constraint

    def accept(self, logits: torch.Tensor | None, sample: Sample | None = None) -> TokenEvent:
        """Sample the next token from logits (or take `sample`, already drawn from them with this request's
        parameters by a batched sampler); update the Generation; set finish_reason when done."""
        sample = self.sampler(logits) if sample is None else sample
        self.sampler.observe(sample.token)
        return self.take(sample.token, sample.logprob, sample.top)
