"""Engine.generate(): prefill, then decode token by token, streaming TokenEvents.

The returned Generation is an iterator; when it is exhausted (or closed early, e.g.
by a disconnected client) its finish_reason, timings, text and token ids are final.
"""

from __future__ import annotations

import time
from typing import Iterator

import torch

from kvtool.config import EngineConfig, SamplingParams, as_sampling_params
from kvtool.engine.output import Generation, OutputState, TokenEvent, scores_prompt
from kvtool.engine.scoring import score_prompt
from kvtool.engine.static import BatchedStaticDecoder, StaticDecoder, fast_decode_enabled, prefill_logits
from kvtool.errors import ContextWindowError, InvalidParameterError
from kvtool.ids import as_token_ids


class Engine:
    """One model, one request at a time; the server's worker owns it."""

    def __init__(self, model, config: EngineConfig | None = None, prefix_cache=None):
        self.model = model
        self.runner = model.runner
        self.config = (config or EngineConfig()).validate()
        self.prefix_cache = prefix_cache  # optional: prepare(prompt, runner) / commit(handle, ids, cache)
        # [/ publish(handle, ids, cache): cache a running request's prompt once prefilled (BatchScheduler)]
        self.end_of_turn = frozenset(model.end_of_turn_ids())
        self._static = None  # StaticDecoder, built on first use when config.fast_decode allows
        self._batched: dict[int, object] = {}  # slots -> BatchedStaticDecoder, shared by this engine's schedulers
        self._grammars = None  # kvtool.engine.constraint.Grammars: the llguidance tokenizer, built on first use

    def static_decoder(self, total_tokens: int):
        """The fast bs=1 decode path for a request of total_tokens, or None (reference path)."""
        if not fast_decode_enabled(self.config.fast_decode, self.runner.device, self.runner.spec):
            return None
        if self._static is None:
            slots = min(self.config.static_max_tokens, self.model.context_window)
            self._static = StaticDecoder(self.runner, slots)
        if self._static.busy or not self._static.fits(total_tokens):
            return None  # another generation of this engine is mid-decode, or too long: reference path
        return self._static

    def batched_static_decoder(self, slots: int):
        """A BatchedStaticDecoder with `slots` rows for continuous batching, or None (eager forward_batch).

        Built once per size and kept, so later schedulers reuse its buffers and captured graphs."""
        if not fast_decode_enabled(self.config.fast_decode, self.runner.device, self.runner.spec):
            return None
        if slots not in self._batched:
            self._batched[slots] = self._new_batched_decoder(slots)
        return self._batched[slots]

    def _new_batched_decoder(self, slots: int):
        from kvtool.cache.manager import default_budget

        bucket = 256
        per_token = self.runner.spec.kv_bytes_per_token(self.runner.dtype.itemsize)
        budget = self.config.static_kv_bytes
        budget = default_budget(self.runner.device) if budget is None else budget
        # every slot gets the same whole buckets, plus its one scratch position
        fit = (budget // (slots * per_token) - 1) // bucket * bucket
        if fit < bucket:
            return None  # too little memory for a useful length: decode through forward_batch
        return BatchedStaticDecoder(self.runner, slots, min(self.config.static_max_tokens, self.model.context_window,
                                                            fit), bucket)

    def constraint(self, params: SamplingParams, stop_ids):
        """The Constraint a request samples under (kvtool.engine.constraint), None for free text; the model's
        llguidance tokenizer is built on the first one."""
        from kvtool.structured.grammar import request_grammar

        if not params.structured:
            return None
        if self._grammars is None:
            from kvtool.engine.constraint import Grammars

            self._grammars = Grammars(self.model.tokenizer, self.runner.spec.vocab_size, self.end_of_turn)
        grammar = request_grammar(params.response_format, params.json_schema, params.json_suffix, params.choice,
                                  params.regex, params.grammar, self._grammars.specials)
        return self._grammars.constraint(grammar, stop_ids)

    def stop_ids(self, params: SamplingParams) -> set[int]:
        """The tokens that end a request's output: its stop_token_ids, and the end of turn unless ignore_eos."""
        return set(params.stop_token_ids) | (set() if params.ignore_eos else self.end_of_turn)

    def check_prompt(self, prompt_ids: list[int], params: SamplingParams) -> int:
        """Validate sizes; return the effective max_tokens."""
        return check_request(prompt_ids, params, self.model.context_window, self.runner.spec.vocab_size,
                             self.stop_ids(params))

    def new_generation(self, prompt_ids: list[int], params: SamplingParams | None = None) -> tuple[Generation, int]:
        """Validate a request; return its (not yet started) Generation and effective max_tokens."""
        params = as_sampling_params(params).validate()
        prompt_ids = as_token_ids(prompt_ids)
        max_tokens = self.check_prompt(prompt_ids, params)
        return Generation(prompt_ids=prompt_ids, params=params), max_tokens

    def generate(self, prompt_ids: list[int], params: SamplingParams | None = None,
                 skip_special_tokens: bool = True) -> Generation:
        gen, max_tokens = self.new_generation(prompt_ids, params)
        gen._events = self._run(gen, max_tokens, skip_special_tokens)
        return gen

    def generate_batch(self, prompts: list[list[int]], params=None, n: int = 1, max_running: int = 16,
                       skip_special_tokens: bool = True) -> list[Generation]:
        """Many prompts (and n choices each) batched together; see kvtool.engine.batch.generate_batch."""
        from kvtool.engine.batch import generate_batch

        return generate_batch(self, prompts, params, n, max_running, skip_special_tokens)

    def start_cache(self, prompt_ids: list[int]):
        """(cache, tokens already in it, hook handle) for a new request: the prefix hook's hit, or empty."""
        if self.prefix_cache is not None:
            return self.prefix_cache.prepare(prompt_ids, self.runner)
        return self.runner.new_cache(len(prompt_ids) + 64), 0, None

    def open_cache(self, gen: Generation, known_ids: list[int], first: bool = True):
        """start_cache() for a request about to run `known_ids` (its prompt, plus its output after a preemption).

        Keeps at least the last known token to run (its logits pick the next token); on the first
        start, records the cached / block / prefilled split in gen.timings. A start that scores the
        prompt (prompt_logprobs not yet complete) keeps nothing: every prompt token's logits are needed.
        """
        cache, ready, handle = self.start_cache(known_ids)
        ready = 0 if scores_prompt(gen) else min(ready, len(known_ids) - 1)
        cache.truncate(ready)
        if first:
            gen.timings.account(len(gen.prompt_ids), ready, getattr(handle, "stats", None))
        return cache, ready, handle

    def _run(self, gen: Generation, max_tokens: int, skip_special_tokens: bool) -> Iterator[TokenEvent]:
        runner, tm = self.runner, gen.timings
        t0 = time.perf_counter()
        cache, cached, handle = self.open_cache(gen, gen.prompt_ids)
        static = None
        try:
            state = OutputState(self, gen, max_tokens, skip_special_tokens, t0)
            # The static rows take the prompt when it fits; a generation that outgrows them moves on to the
            # reference path (its KV handed back to the cache), so no max_tokens keeps a request off the fast path.
            static = self.static_decoder(len(gen.prompt_ids) + 1)
            if scores_prompt(gen):
                logits, gen.prompt_logprobs = score_prompt(runner, cache, gen.prompt_ids, gen.params.prompt_logprobs,
                                                           self.config.prefill_chunk)
                if static is not None:
                    static.load(cache)
            else:
                logits = prefill_logits(runner, cache, gen.prompt_ids[cached:], self.config.prefill_chunk, static)
            tm.prefill_ms = state.ms()
            while True:
                event = state.accept(logits)
                yield event
                if gen.finish_reason:
                    break
                if static is not None and static.length >= static.max_len:
                    static.store(cache)
                    static = None
                if static is not None:
                    logits = static.step(event.token_id)
                else:
                    logits = runner.forward(torch.tensor([event.token_id]), cache)
        finally:
            if static is not None and static.busy:
                static.store(cache)
            if gen.finish_reason is None:
                gen.finish_reason = "abort"
            if self.prefix_cache is not None:
                # The last sampled token has no KV yet; the cache holds prompt + all but the last.
                self.prefix_cache.commit(handle, (gen.prompt_ids + gen.token_ids)[: cache.offset], cache)


def check_request(prompt_ids: list[int], params: SamplingParams, window: int, vocab: int, stop_ids: set[int]) -> int:
    """Validate a request's sizes against a context window and vocabulary (any engine); return its effective
    max_tokens. stop_ids: the tokens that end its output."""
    if not prompt_ids:
        raise InvalidParameterError("the prompt is empty; give at least one token")
    bad = [t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < vocab]
    if bad:
        raise InvalidParameterError(f"prompt token ids must be in [0, {vocab}); got {bad[:5]}")
    for name in ("logit_bias", "allowed_token_ids"):
        bad = sorted(t for t in getattr(params, name) or () if t >= vocab)
        if bad:
            raise InvalidParameterError(f"{name} token ids must be in [0, {vocab}); got {bad[:5]}")
    if len(prompt_ids) >= window:
        raise ContextWindowError(f"the prompt has {len(prompt_ids)} tokens; the model's context window is "
                                 f"{window} tokens and must leave room for at least 1 new token")
    if params.min_tokens and params.allowed_token_ids is not None and set(params.allowed_token_ids) <= stop_ids:
        raise InvalidParameterError("allowed_token_ids lists only stop tokens, which min_tokens holds back: "
                                    "nothing could be drawn")
    max_tokens = params.max_tokens if params.max_tokens is not None else window - len(prompt_ids)
    if params.min_tokens > max_tokens:
        raise ContextWindowError(f"min_tokens ({params.min_tokens}) does not fit: the context window of {window} "
                                 f"tokens leaves {max_tokens} after the prompt")
    if len(prompt_ids) + max_tokens > window:
        raise ContextWindowError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) = "
                                 f"{len(prompt_ids) + max_tokens} exceeds the context window of {window} tokens")
    return max_tokens
