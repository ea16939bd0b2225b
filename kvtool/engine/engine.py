"""Engine: one model, its scheduler, and the one request path every caller takes.

Engine.generate() adds a request to the engine's scheduler (kvtool.engine.scheduler) and steps it until the request
is done, streaming its TokenEvents; the CLI, the inspector, the in-process agent backend, generate_batch() and the
server's worker all run requests through that same scheduler; the engine's StepExecutor (kvtool.engine.step) runs
its steps, and the engine opens, publishes and closes each request's KV through its prefix-cache hook. The returned
Generation is an iterator; when it is exhausted (or closed early, e.g. by a disconnected client) its finish_reason,
timings, text and token ids are final.
"""

from __future__ import annotations

import logging
import warnings
from collections import deque
from collections.abc import Sequence
from typing import Iterator

from kvtool.cache.hook import PrefixHook, checked_hook
from kvtool.cache.kv import KVCache
from kvtool.cache.store import BlockPool, kv_dtype, memory_split
from kvtool.config import EngineConfig, SamplingParams, as_sampling_params
from kvtool.engine.forks import choices
from kvtool.engine.output import Generation, TokenEvent, scores_prompt
from kvtool.engine.scheduler import BatchScheduler
from kvtool.engine.step import StepExecutor
from kvtool.errors import InvalidParameterError, PrefixCacheWarning
from kvtool.ids import as_token_ids, check_request

log = logging.getLogger("kvtool.engine")


class Engine:
    """One model and the scheduler its requests share; in a server, the worker thread steps it."""

    def __init__(self, model, config: EngineConfig | None = None, prefix_cache=None):
        self.model = model
        self.runner = model.runner
        self.config = (config or EngineConfig()).validate()
        if self.config.forward == "cpu-ops" != self.runner.forward_path:  # (the ops are set up when a model loads)
            raise InvalidParameterError("forward='cpu-ops', but this model was loaded without the C++ CPU ops")
        self.paged = self.runner.cpu_decode and self.config.forward != "reference"  # its steps run the C++ ops
        self.prefix_cache = prefix_cache  # optional: a PrefixHook (kvtool.cache.hook), checked by the setter
        # (running requests' KV bytes, prefix-cache bytes): the engine's one memory budget, split once here
        self.memory = memory_split(self.config.kv_bytes, self.config.cache_bytes, self.runner.device)
        self.pool = BlockPool.for_runner(self.runner, self.config.prefix_block, self.memory[0] if self.paged else 0,
                                         kv_dtype(self.config, self.runner, self.paged))  # the requests' share
        self.end_of_turn = frozenset(model.end_of_turn_ids())
        self._scheduler: BatchScheduler | None = None
        self.executor = StepExecutor(self)  # runs the scheduler's plans: the forward and the sampling of each step
        self._grammars = None  # kvtool.engine.constraint.Grammars: the llguidance tokenizer, built on first use

    @property
    def prefix_cache(self) -> PrefixHook | None:
        """What gives each request its starting KV (prepare), and takes it back (publish, commit)."""
        return self._prefix_cache

    @prefix_cache.setter
    def prefix_cache(self, hook: PrefixHook | None) -> None:
        self._prefix_cache = checked_hook(hook)

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
                                  params.regex, params.grammar, self._grammars.specials, self._grammars.unwritable,
                                  checked=False, strict=params.strict)  # validate() checked it; the matcher compiles
        return self._grammars.constraint(grammar, stop_ids)

    def stop_ids(self, params: SamplingParams) -> set[int]:
        """The tokens that end a request's output: its stop_token_ids, and the end of turn unless ignore_eos."""
        return set(params.stop_token_ids) | (set() if params.ignore_eos else self.end_of_turn)

    def check_prompt(self, prompt_ids: list[int], params: SamplingParams) -> int:
        """Validate sizes; return the effective max_tokens."""
        return check_request(prompt_ids, params, self.model.context_window, self.runner.spec.vocab_size,
                             self.stop_ids(params))

    def new_generation(self, prompt_ids: list[int], params: SamplingParams | None = None) -> tuple[Generation, int]:
        """Validate a request (unset sampling fields: the model's); return its Generation and effective max_tokens."""
        params = as_sampling_params(params).with_defaults(self.model.sampling_defaults).validate()
        prompt_ids = as_token_ids(prompt_ids)
        max_tokens = self.check_prompt(prompt_ids, params)
        return Generation(prompt_ids=prompt_ids, params=params, _constraint=self.constraint(
            params, self.stop_ids(params))), max_tokens

    @property
    def scheduler(self) -> BatchScheduler:
        """The scheduler every request of this engine runs through (generate(), generate_batch(), the server's
        worker), built on first use from EngineConfig's max_running, prefill_chunk and kv_bytes."""
        if self._scheduler is None:
            c = self.config
            self._scheduler = BatchScheduler(self, c.max_running, c.prefill_chunk,  # the pool counts, if sized
                                             None if self.pool.blocks else kv_budget_tokens(self))
        return self._scheduler

    def generate(self, prompt_ids: list[int], params: SamplingParams | None = None,
                 skip_special_tokens: bool = True) -> Generation:
        """Validate a request and return its Generation; iterating it adds the request to the scheduler and steps
        until it is done."""
        gen, max_tokens = self.new_generation(prompt_ids, params)
        gen._events = self._follow(gen, max_tokens, skip_special_tokens)
        return gen

    def generate_batch(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                       n: int = 1, skip_special_tokens: bool = True) -> list[Generation]:
        """Every prompt (token ids) n times through the scheduler, as vLLM's LLM.generate: the finished Generations,
        choice i of prompt p at p * n + i. A list of params gives each prompt its own; a seed s gives choice i the
        seed s + i (it then equals a single run seeded s + i); a prompt's choices prefill it once."""
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise InvalidParameterError(f"prompts must be a list of prompts (token id lists); got "
                                        f"{type(prompts).__name__}")
        prompts = [as_token_ids(ids, f"prompts[{i}]") for i, ids in enumerate(prompts)]
        per_prompt = [as_sampling_params(p) for p in params] if isinstance(params, list) else \
            [as_sampling_params(params)] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise InvalidParameterError(f"{len(per_prompt)} SamplingParams for {len(prompts)} prompts; give one, or "
                                        "one per prompt")
        if not isinstance(n, int) or n < 1:
            raise InvalidParameterError(f"n must be an integer >= 1, got {n!r}")
        gens, sched = [], self.scheduler
        try:  # all are validated before any is queued
            checked = [(*self.new_generation(ids, p), shared) for ids, p, shared in choices(prompts, per_prompt, n)]
            for gen, max_tokens, shared in checked:
                sched.add(gen, max_tokens, skip_special_tokens, shared=shared)
                gens.append(gen)
            while any(g.finish_reason is None for g in gens):
                sched.step()
        finally:  # interrupted: what it queued leaves the scheduler
            for gen in gens:
                if gen.finish_reason is None:
                    sched.cancel(gen)
        return gens

    def start_cache(self, prompt_ids: list[int]):
        """(cache, tokens already in it, hook handle) for a new request: the prefix hook's hit, or empty (paged,
        from the pool, where the C++ CPU ops run the model)."""
        if self.prefix_cache is not None:
            return self.prefix_cache.prepare(prompt_ids, self.runner)
        return (KVCache.paged([], self.pool.take(), 0, 0, self.pool.take) if self.paged
                else self.runner.new_cache(len(prompt_ids) + 64)), 0, None

    def open_cache(self, gen: Generation, known_ids: list[int], first: bool = True):
        """start_cache() for a request about to run `known_ids` (its prompt, plus its output after a preemption).

        Keeps at least the last known token to run (its logits pick the next token); on the first
        start, records the cached / block / prefilled split in gen.timings. A start that scores the
        prompt (prompt_logprobs not yet complete) keeps nothing: every prompt token's logits are needed."""
        cache, ready, handle = self.start_cache(known_ids)
        ready = 0 if scores_prompt(gen) else min(ready, len(known_ids) - 1)
        cache.truncate(ready)
        if first:
            hook = self.prefix_cache
            gen.timings.account(len(gen.prompt_ids), ready, hook.splice_stats(handle) if hook is not None else None)
        return cache, ready, handle

    def publish(self, prompt_ids: list[int], cache: KVCache, handle) -> None:
        """A request's prompt is in its cache: the prefix hook shares it now, while the request still decodes."""
        if self.prefix_cache is not None:
            self.prefix_cache.publish(handle, prompt_ids[: cache.offset], cache)

    def close_cache(self, known_ids: list[int], cache: KVCache | None, handle) -> None:
        """A request's KV goes back to the prefix hook (commit of its first cache.offset known ids). A failure warns
        and never raises: the request (and the batch) it ends must not fail for it."""
        if cache is None or self.prefix_cache is None:
            return
        try:
            self.prefix_cache.commit(handle, known_ids[: cache.offset], cache)
        except Exception as exc:
            warnings.warn(PrefixCacheWarning(f"prefix cache: taking back a finished request's KV failed "
                                             f"({type(exc).__name__}: {exc}); it is not cached"), stacklevel=3)

    def fork_cache(self, cache: KVCache, prompt_ids: list[int]) -> tuple[KVCache, object]:
        """(a copy of a prompt's KV for another request, its hold): the hook's fork (PrefixCache's reads the prompt's
        cached blocks in place on the C++ CPU path), else KVCache.fork (over its own full blocks where it is paged)."""
        hook = self.prefix_cache
        return hook.fork(cache, prompt_ids, self.runner) if hook is not None else (cache.fork(), None)

    def _follow(self, gen: Generation, max_tokens: int, skip_special_tokens: bool) -> Iterator[TokenEvent]:
        """Add gen to the scheduler and step it until gen is done, yielding gen's events as they come (whatever
        else the scheduler holds advances in the same steps). Closed early, gen ends with "abort"; a request
        that failed raises its error here."""
        events: deque[TokenEvent] = deque()
        ended: list[BaseException | None] = []
        sched = self.scheduler
        sched.add(gen, max_tokens, skip_special_tokens, on_event=events.append,
                  on_finish=lambda _gen, error: ended.append(error))
        try:
            while events or not ended:
                if events:
                    yield events.popleft()
                else:
                    sched.step()
        finally:
            if not ended:
                sched.cancel(gen)  # its KV goes to the prefix cache as at any end
        if ended[0] is not None:
            raise ended[0]


def kv_budget_tokens(engine: Engine) -> int:
    """The running requests' KV budget (Engine.memory's first share: EngineConfig.kv_bytes, else half the engine's
    memory budget) in tokens of this model's KV."""
    budget = engine.memory[0]
    tokens = budget // engine.runner.spec.kv_bytes_per_token(engine.runner.dtype.itemsize)
    if tokens < engine.model.context_window:
        log.warning("the KV budget (%d bytes) holds %d tokens, less than the %d-token context window: a request "
                    "longer than that runs alone", budget, tokens, engine.model.context_window)
    return tokens
