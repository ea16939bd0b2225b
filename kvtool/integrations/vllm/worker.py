"""VllmCore: vLLM's LLMEngine (in-process engine core) as kvtool's engine core (kvtool.serving.core), which the
serving Worker drives as it drives kvtool's own: between two engine steps its thread adds the submitted requests
and aborts the cancelled ones, then steps; vLLM does the scheduling (continuous
batching, chunked prefill, automatic prefix caching) and the forward passes. Each new token id goes
through kvtool's OutputText, so pieces, text, stop strings, timings and finish reasons are kvtool's.
Cached tokens are vLLM's own count (RequestOutput.num_cached_tokens); with kvtool's KV connector mounted, its
account of the request (the finished output's kv_transfer_params["kvtool"]) splits them into vLLM's prefix cache
plus the block store (cached) and the skill blocks it supplied (skill_block_tokens).
"""

from __future__ import annotations

import itertools
import logging

from kvtool.config import SamplingParams, as_sampling_params
from kvtool.engine import Generation
from kvtool.engine.output import OutputText
from kvtool.ids import as_token_ids, check_request
from kvtool.integrations.vllm.sampling import prompt_rows, to_vllm, top_list
from kvtool.serving.core import Output
from kvtool.serving.worker import RequestFailed, WorkerCrash

log = logging.getLogger("kvtool.serving")


class VllmRequest:
    """A request's vLLM side: its request id and the OutputText that turns its token ids into events."""

    def __init__(self, gen: Generation, request_id: str, output: OutputText):
        self.gen, self.request_id, self.output = gen, request_id, output


class VllmCore:
    """vLLM's LLMEngine as an engine core (kvtool.serving.core.EngineCore), driven by the serving Worker."""

    name = "vllm"
    shares_forks = False  # each choice is its own vLLM request (vLLM's prefix cache shares the prompt's blocks)
    scheduler = None  # (kvtool's BatchScheduler gauges: none here; vLLM's metrics are exposed instead)

    def __init__(self, engine, model, max_running: int = 16, catalog=None):
        """engine: a vllm LLMEngine; model: the TextModel (tokenizer, end of turn, context window) it serves;
        catalog: the skills kvtool's connector supplies, if mounted (responses then report each request's path)."""
        self.engine, self.model, self.catalog, self.max_running = engine, model, catalog, max_running
        self.end_of_turn = frozenset(model.end_of_turn_ids())
        self.specials = {a.content: i for i, a in model.tokenizer.added_tokens_decoder.items()}
        self._live: dict[str, VllmRequest] = {}  # vLLM request id -> request
        self._ids = itertools.count()
        self._out: list[Output] = []

    def stop_ids(self, params: SamplingParams) -> set[int]:
        return set(params.stop_token_ids) | (set() if params.ignore_eos else self.end_of_turn)

    def new_generation(self, prompt_ids: list[int], params: SamplingParams) -> tuple[Generation, int]:
        params = as_sampling_params(params).with_defaults(self.model.sampling_defaults).validate()
        ids = as_token_ids(prompt_ids)
        max_tokens = check_request(ids, params, self.model.context_window, self.model.spec.vocab_size,
                                   self.stop_ids(params))
        return Generation(prompt_ids=ids, params=params), max_tokens

    @property
    def queued(self) -> int:
        return 0  # vLLM's own waiting queue counts as running here

    @property
    def idle(self) -> bool:
        return not self._live and not self._out

    def add(self, req) -> None:
        gen = req.gen
        output = OutputText(self.model.tokenizer, self.stop_ids(gen.params), gen, req.max_tokens,
                            req.skip_special_tokens, req.submitted)
        rid = f"kvtool-{next(self._ids)}"  # outputs and aborts use this id (vLLM keeps its own inside)
        try:
            params = to_vllm(gen.params, req.max_tokens, output.stops, self.specials)
            self.engine.add_request(rid, {"prompt_token_ids": gen.prompt_ids}, params)
        except Exception as exc:  # vLLM refused the request (e.g. a schema its grammar backend cannot take)
            raise RequestFailed(f"vLLM refused the request: {exc}") from exc
        self._live[rid] = VllmRequest(gen, rid, output)

    def abort(self, gens: list[Generation]) -> list[Output]:
        ids = {id(g) for g in gens}
        self._abort([r for r in self._live.values() if id(r.gen) in ids])
        return self._take()

    def step(self) -> list[Output]:
        if self._live:
            for out in self.engine.step():
                self._on_output(out)
            if self._live and not self.engine.has_unfinished_requests():  # never spin on lost requests
                for req in list(self._live.values()):
                    self._end(req, WorkerCrash("vLLM dropped the request without an answer"))
        return self._take()

    def fail(self, error: BaseException) -> list[Output]:
        for req in list(self._live.values()):
            self._end(req, error)
        return self._take()

    def _take(self) -> list[Output]:
        out, self._out = self._out, []
        return out

    def _abort(self, reqs: list[VllmRequest]) -> None:
        if not reqs:
            return
        try:
            self.engine.abort_request([r.request_id for r in reqs])
        except Exception:
            log.exception("aborting vLLM requests failed")
        for req in reqs:
            req.gen.finish_reason = req.gen.finish_reason or "abort"
            self._end(req)

    def _on_output(self, out) -> None:
        req = self._live.get(out.request_id)
        if req is None:
            return
        gen, output = req.gen, req.output
        if out.prompt_logprobs is not None and gen.params.prompt_logprobs is not None and gen.prompt_logprobs is None:
            gen.prompt_logprobs = prompt_rows(gen.prompt_ids, out.prompt_logprobs, gen.params.prompt_logprobs)
        completion = out.outputs[0] if out.outputs else None
        if completion is not None:
            if output.t_first is None and completion.token_ids:
                n = len(gen.prompt_ids)
                gen.timings.account(n, min(out.num_cached_tokens or 0, n))
            lps = completion.logprobs or []
            for j, tok in enumerate(completion.token_ids):
                if gen.finish_reason:
                    break
                entry = lps[j] if j < len(lps) else None
                own = entry.get(tok) if entry else None
                event = output.take(tok, None if own is None else own.logprob,
                                    top_list(entry, gen.params.logprobs) if gen.params.logprobs is not None else None)
                self._out.append(Output(gen, event))
            if gen.timings.ttft_ms and not gen.timings.prefill_ms:
                gen.timings.prefill_ms = gen.timings.ttft_ms - gen.timings.queue_ms
        if gen.finish_reason and not out.finished:  # kvtool's stop came first (e.g. a stop string)
            self._abort([req])
        elif out.finished:
            self._account(req, (getattr(out, "kv_transfer_params", None) or {}).get("kvtool"))
            if gen.finish_reason is None:
                gen.finish_reason = completion.finish_reason if completion and completion.finish_reason in (
                    "stop", "length") else "abort"
            self._end(req)

    def _account(self, req: VllmRequest, acc: dict | None) -> None:
        """The connector's account (kvtool.integrations.vllm.connector.account) splits vLLM's cached tokens."""
        if acc is None:
            return
        gen, n = req.gen, len(req.gen.prompt_ids)
        gen.timings.account(n, min(acc["local_tokens"] + acc["store_tokens"], n))
        gen.timings.skill_block_tokens = acc["block_tokens"]
        if self.catalog is not None:
            gen.timings.skill_path, gen.timings.skill_path_reason = acc["skill_path"], acc["skill_path_reason"]
        gen.timings.prefill_tokens = n - gen.timings.cached_tokens - acc["block_tokens"]

    def _end(self, req: VllmRequest, error: BaseException | None = None) -> None:
        self._live.pop(req.request_id, None)
        self._out.append(Output(req.gen, finished=True, error=error))
