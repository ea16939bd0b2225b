"""llama.cpp's POST /completion: its request fields, its flat answer and its SSE stream (no [DONE]). The body
becomes a GenerationRequest, so values, stop strings, `grammar` and `json_schema` are refused as on /v1/completions,
by llama.cpp's names; the non-streaming answer is the fold of the stream's events, as in session.py."""

from __future__ import annotations

import json
import re
from typing import Annotated, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BeforeValidator, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from kvtool.config import SamplingParams
from kvtool.errors import ContextWindowError, InvalidParameterError
from kvtool.serving.errors import ServingError
from kvtool.serving.protocol import MAX_STOP_STRINGS, SEED_RANGE, GenerationRequest, StopString, Strict, documented
from kvtool.serving.served import ServedModel
from kvtool.serving.session import chunk_error, finite, stream_error
from kvtool.serving.worker import Handle, WorkerCrash

KVTOOL_NAMES = {"max_tokens": "n_predict", "repetition_penalty": "repeat_penalty", "logprobs": "n_probs"}
OFF = {"mirostat": 0, "typical_p": 1.0, "dry_multiplier": 0.0, "xtc_probability": 0.0, "dynatemp_range": 0.0,
       "post_sampling_probs": False}  # llama.cpp samplers kvtool lacks: taken only at these values
BiasPair = Annotated[tuple[int | str, float | bool],  # [token id or text, bias]; JSON has no tuples
                     BeforeValidator(lambda v: tuple(v) if isinstance(v, list) else v)]


class LlamaCompletionRequest(Strict):
    model_config = ConfigDict(strict=True, extra="allow")  # other fields are ignored, but those of OFF are read
    prompt: str | list[int | str]  # text, token ids, or both mixed; several prompts are a 400
    n_predict: int = -1  # -1: up to the server's --default-max-tokens (else the context window); 0: prefill only
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stop: StopString | Annotated[list[StopString], documented(maxItems=MAX_STOP_STRINGS)] | None = None
    seed: int | None = Field(default=None, **SEED_RANGE)  # -1: a random seed, as llama.cpp
    stream: bool = False
    grammar: str | None = None  # GBNF or Lark
    json_schema: dict[str, Any] | bool | None = None
    ignore_eos: bool = False
    n_probs: int = 0
    logit_bias: list[BiasPair] | dict[str, float | bool] | None = None  # a bias of false: never drawn
    cache_prompt: bool = True  # kvtool's prefix cache serves every request
    return_tokens: bool = False
    model: str | None = None

    def sampling(self, served: ServedModel, default_max_tokens: int | None) -> SamplingParams:
        for name, off in OFF.items():
            if (self.model_extra or {}).get(name, off) != off:
                raise ServingError(f"{name} is not implemented by kvtool; leave it out or at {off}", name)
        if self.n_predict < -1:
            raise ServingError(f"n_predict must be -1 (no limit), 0 or more, got {self.n_predict}", "n_predict")
        bias: dict[str, float] = {}
        keyed = isinstance(self.logit_bias, dict)  # {"id": bias}; a key that is no id is text, as in [["text", bias]]
        for key, value in self.logit_bias.items() if keyed else self.logit_bias or []:
            if value is True:
                raise ServingError(f"the logit_bias of {key!r} is true; give a number, or false to ban it",
                                   "logit_bias")
            ids = [key] if isinstance(key, int) or keyed and key.strip().isdecimal() else served.encode(key, False)
            bias |= {str(t): -100.0 if value is False else float(value) for t in ids}  # -100: kvtool's floor
        kvtool = GenerationRequest(
            temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
            repetition_penalty=self.repeat_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, stop=self.stop, seed=None if self.seed == -1 else self.seed,
            grammar=self.grammar, json_schema=self.json_schema, ignore_eos=self.ignore_eos, logit_bias=bias)
        try:  # n_predict 0 prefills the prompt and draws one token, which is not returned
            return kvtool.sampling(default_max_tokens, None if self.n_predict == -1 else max(self.n_predict, 1),
                                   logprobs=self.n_probs or None)
        except InvalidParameterError as exc:
            kv = re.match(r"invalid sampling parameter (\w+)", str(exc))
            name = kv and KVTOOL_NAMES.get(kv[1], kv[1])
            raise ServingError(str(exc).replace(kv[1], name, 1) if kv else str(exc), name) from None

    def prompt_ids(self, served: ServedModel) -> list[int]:
        parts = [self.prompt] if isinstance(self.prompt, str) else self.prompt
        if len(parts) > 1 and all(isinstance(p, str) for p in parts):
            raise ServingError("send one prompt per request (text, token ids, or both mixed); /v1/completions "
                               "takes several", "prompt")
        return [t for i, p in enumerate(parts)  # special tokens (BOS) only before text that opens the prompt
                for t in ([p] if isinstance(p, int) else served.encode(p, add_special_tokens=i == 0))]


class LlamaSession:
    """One /completion request: an event {content, tokens, stop: false} per token, then a last one with stop: true
    and the summary (stop_type, timings, generation_settings, ...)."""

    def __init__(self, served: ServedModel, handle: Handle, body: LlamaCompletionRequest, prompt_ids: list[int]):
        self.served, self.handle, self.body, self.prompt_ids = served, handle, body, prompt_ids

    def _probability(self, token: int, logprob: float, top=None) -> dict:
        piece = self.served.piece(token)
        out = {"id": token, "token": piece, "bytes": list(piece.encode()), "logprob": finite(logprob)}
        return out if top is None else {**out, "top_logprobs": [self._probability(t, lp) for t, lp in top]}

    async def events(self):
        """An event per token ("" while a stop string may be starting), then the summary."""
        try:
            async for ev in self.handle:
                if not self.body.n_predict:  # 0: the one token drawn after the prefill is not returned
                    continue
                event = {"content": ev.text, "tokens": [ev.token_id], "stop": False}
                if ev.logprob is not None:
                    event["completion_probabilities"] = [self._probability(ev.token_id, ev.logprob,
                                                                           ev.top_logprobs or [])]
                yield event
        except (WorkerCrash, ServingError) as exc:
            yield {"error": stream_error(exc)["error"]}
            return
        yield self.summary()

    def summary(self) -> dict:
        gen, params, served = self.handle.gen, self.handle.gen.params, self.served
        t, predicted = gen.timings, len(gen.token_ids) if self.body.n_predict else 0
        word = isinstance(gen.stop_reason, str)  # a stop string ended it
        settings = {KVTOOL_NAMES.get(f, f): getattr(params, f) for f in (
            "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
            "stop", "ignore_eos", "json_schema")}
        settings.update(n_predict=params.max_tokens or -1 if self.body.n_predict else 0, n_probs=self.body.n_probs,
                        seed=-1 if params.seed is None else params.seed, grammar=params.grammar or "",
                        logit_bias=[[int(k), v] for k, v in params.logit_bias.items()], stream=self.body.stream,
                        cache_prompt=True, n_ctx=served.context_window, model=served.name)
        timings = {"cache_n": t.cached_tokens, "prompt_n": t.prefill_tokens, "prompt_ms": round(t.prefill_ms, 3),
                   "prompt_per_second": round(t.prefill_tokens_per_s, 2), "predicted_n": predicted,
                   "predicted_ms": round(t.decode_ms, 3) if predicted else 0.0,
                   "predicted_per_second": round(t.decode_tokens_per_s, 2) if predicted else 0.0}
        return {"content": "", "tokens": [], "stop": True, "model": served.name,
                "prompt": served.decode(self.prompt_ids), "tokens_predicted": predicted,
                "tokens_evaluated": len(gen.prompt_ids), "tokens_cached": t.cached_tokens,
                "stop_type": "limit" if gen.finish_reason == "length" or not self.body.n_predict else "word" if word
                else "eos", "stopping_word": gen.stop_reason if word else "",
                "truncated": False,  # kvtool never drops context: a prompt that does not fit is a 400
                "timings": timings, "generation_settings": settings}

    async def response(self) -> dict:
        """The non-streaming answer: the fold of events()."""
        content, tokens, probabilities = [], [], []
        async for event in self.events():
            if "error" in event:
                raise chunk_error(event)
            content.append(event["content"])
            tokens += event["tokens"]
            probabilities += event.get("completion_probabilities", [])
        out = {**event, "content": "".join(content), "tokens": tokens if self.body.return_tokens else []}
        if self.body.n_probs:
            out["completion_probabilities"] = probabilities
        return out


def llama_router(worker, served: ServedModel, default_max_tokens: int | None, until_done) -> APIRouter:
    """POST /completion on the server's worker (either engine); until_done(request, handle, awaitable): app.py's."""
    router = APIRouter()

    @router.post("/completion")
    async def completion(body: LlamaCompletionRequest, request: Request):
        """llama.cpp's completion: {content, stop, stop_type, timings, ...}, or SSE events, the last with stop: true."""
        served.check_name(body.model)
        params = body.sampling(served, default_max_tokens)
        ids = await run_in_threadpool(body.prompt_ids, served)
        try:
            handle = (await worker.enqueue([ids], 1, params))[0]
        except ContextWindowError as exc:  # "prompt + max_tokens exceeds the window", in llama.cpp's name
            raise ContextWindowError(str(exc).replace("max_tokens", "n_predict")) from None
        session = LlamaSession(served, handle, body, ids)
        if not body.stream:
            return JSONResponse(await until_done(request, handle, session.response()))

        async def sse():
            try:
                async for event in session.events():
                    yield f"data: {json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n"
            finally:
                handle.cancel()

        return StreamingResponse(sse(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return router
