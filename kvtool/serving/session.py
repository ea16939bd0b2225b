"""One request's token events -> OpenAI chunks (streaming) or one response object.

The non-streaming response is the fold of the same chunks, so both paths agree by
construction. Chat chunks follow OpenAI: role first, content / reasoning_content deltas,
tool calls as a header delta (index, id, type, name, arguments "") then an arguments
delta, a finish chunk (with kvtool's `timings`), and a usage chunk with no choices.

A tool call is streamed once it is sealed (`</tool_call>` or complete JSON at the end),
so a client never sees the start of a call that turns out to be plain text.
"""

from __future__ import annotations

import secrets
import time
from typing import AsyncIterator

from kvtool.engine import TokenEvent
from kvtool.serving.chat import PreparedChat
from kvtool.serving.errors import ServingError, Unavailable, error_body
from kvtool.serving.served import ServedModel
from kvtool.serving.toolparse import OutputParser, ParseEvent, ToolFormat
from kvtool.serving.worker import Handle, RequestFailed, WorkerCrash


def finite(logprob: float | None) -> float | None:
    """JSON has no -inf; a token the model rules out entirely gets -9999 (as vLLM does)."""
    return None if logprob is None else max(logprob, -9999.0)


UNENFORCED_HEADER = "x-kvtool-unenforced"  # the JSON schema's keywords the grammar leaves out, comma-separated


def timings_dict(gen) -> dict:
    out = {k: round(v, 2) if isinstance(v, float) else v for k, v in gen.timings.to_dict().items()}
    if gen.params.response_format == "json_schema":  # what of the schema the output was held to
        out["structured_output"] = {"strict": gen.params.strict,
                                    "unenforced": [u.keyword for u in gen.params.unenforced]}
    return out


def unenforced_headers(params) -> dict[str, str]:
    """The response header naming the keywords of the request's JSON schema that were not enforced (none: {})."""
    names = [u.keyword for u in params.unenforced]
    return {UNENFORCED_HEADER: ",".join(names)} if names else {}


def usage_dict(gen, reasoning_tokens: int | None = None) -> dict:
    usage = {"prompt_tokens": len(gen.prompt_ids), "completion_tokens": len(gen.token_ids),
             "total_tokens": len(gen.prompt_ids) + len(gen.token_ids),
             "prompt_tokens_details": {"cached_tokens": gen.timings.cached_tokens}}
    if gen.timings.skill_block_tokens:
        usage["prompt_tokens_details"]["skill_block_tokens"] = gen.timings.skill_block_tokens
    if reasoning_tokens is not None:
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return usage


def prompt_logprobs_json(served: ServedModel, rows) -> list | None:
    """vLLM's prompt_logprobs: per prompt token None (the first) or {token id: {logprob, rank, decoded_token}}
    for the token itself and its top alternatives."""
    if rows is None:
        return None
    out: list = []
    for r in rows:
        if r.logprob is None:
            out.append(None)
            continue
        entry = {str(r.token_id): {"logprob": finite(r.logprob), "rank": r.rank, "decoded_token": served.piece(r.token_id)}}
        for rank, (t, lp) in enumerate(r.top, start=1):
            entry.setdefault(str(t), {"logprob": finite(lp), "rank": rank, "decoded_token": served.piece(t)})
        out.append(entry)
    return out


def finish_reason(gen, called: bool) -> str:
    if called:
        return "tool_calls"
    return "length" if gen.finish_reason == "length" else "stop"


def aborted(exc: Exception) -> bool:
    """Whether exc ended the request because the server is shutting down (its stream ends with finish_reason
    "abort", then the error)."""
    return getattr(exc, "code", None) == "shutting_down"


def stream_error(exc: Exception) -> dict:
    status = getattr(exc, "status_code", 500)
    return error_body(status, str(exc), code=getattr(exc, "code", None))


def chunk_error(chunk: dict) -> ServingError:
    """What a non-streaming response raises for its stream's error chunk: a 400 stays a 400, the rest are 500s."""
    err = chunk["error"]
    if err.get("code") == "shutting_down":
        return Unavailable(err["message"], err.get("param"), err["code"])
    return (RequestFailed if err["type"] == "invalid_request_error" else WorkerCrash)(err["message"], err.get("param"),
                                                                                      err.get("code"))


class ChatSession:
    def __init__(self, served: ServedModel, prepared: PreparedChat, handle: Handle, fmt: ToolFormat,
                 raw_tokens: bool = False, parallel_tool_calls: bool = True, index: int = 0,
                 first: "ChatSession | None" = None):
        """index: this choice's; first: choice 0's session, whose id and time the other choices share."""
        self.served, self.prepared, self.handle, self.index = served, prepared, handle, index
        self.parser = OutputParser(prepared.tools, fmt, in_reasoning=prepared.in_reasoning)
        self.raw_tokens, self.parallel = raw_tokens, parallel_tool_calls
        self.id = first.id if first else "chatcmpl-" + secrets.token_hex(12)
        self.created = first.created if first else int(time.time())
        self.tag_raw = False  # raw tokens carry their choice's index (set when a response has several)
        self.calls = 0
        self.reasoning_tokens = 0
        self.sealed = False  # parallel_tool_calls=false: generation ends at the first call

    def _chunk(self, delta: dict | None, finish: str | None = None, **extra) -> dict:
        choices = [] if delta is None else [{"index": self.index, "delta": delta, "logprobs": None,
                                              "finish_reason": finish}]
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.served.name, "choices": choices, **extra}

    def _deltas(self, events: list[ParseEvent]) -> list[dict]:
        out = []
        for ev in events:
            if self.sealed:
                break
            if ev.call is None:
                out.append({"reasoning_content" if ev.channel == "reasoning" else "content": ev.text})
                continue
            index, self.calls = self.calls, self.calls + 1
            out.append({"tool_calls": [{"index": index, "id": ev.call.id, "type": "function",
                                        "function": {"name": ev.call.name, "arguments": ""}}]})
            out.append({"tool_calls": [{"index": index, "function": {"arguments": ev.call.arguments}}]})
            if not self.parallel:
                self.sealed = True
                self.handle.cancel()
        return out

    def _logprob(self, ev: TokenEvent) -> dict:
        piece = ev.piece
        top = [{"token": (p := self.served.piece(t)), "logprob": finite(v), "bytes": list(p.encode())}
               for t, v in (ev.top_logprobs or [])]
        return {"token": piece, "logprob": finite(ev.logprob), "bytes": list(piece.encode()), "top_logprobs": top}

    async def chunks(self) -> AsyncIterator[dict]:
        """Every chunk, the usage chunk last; an engine failure becomes an {"error": ...} chunk."""
        yield self._chunk({"role": "assistant", "content": ""})
        lps: list[dict] = []
        deltas = self._deltas(self.parser.feed(self.prepared.prefill)) if self.prepared.prefill else []
        try:
            async for ev in self.handle:
                raw = None
                if not self.sealed:
                    deltas += self._deltas(self.parser.feed(ev.text))
                    special = ev.token_id in self.served.special_ids
                    channel = "special" if special else self.parser.last
                    self.reasoning_tokens += channel == "reasoning"
                    raw = {"id": ev.token_id, "piece": ev.piece, "channel": channel, "t_ms": round(ev.t_ms, 2)}
                    if self.tag_raw:
                        raw["index"] = self.index
                if ev.logprob is not None:
                    lps.append(self._logprob(ev))
                if not deltas and not (self.raw_tokens and raw):
                    continue
                for i, delta in enumerate(deltas or [{}]):
                    chunk = self._chunk(delta)
                    if i == 0 and lps:
                        chunk["choices"][0]["logprobs"], lps = {"content": lps}, []
                    if i == 0 and self.raw_tokens and raw:
                        chunk["raw_tokens"] = [raw]
                    yield chunk
                deltas = []
        except (WorkerCrash, ServingError) as exc:
            if aborted(exc):
                yield self._chunk({}, "abort")
            yield {"error": stream_error(exc)["error"]}
            return
        if not self.sealed:
            deltas += self._deltas(self.parser.finish())
        for delta in deltas:
            yield self._chunk(delta)
        gen = self.handle.gen
        last = self._chunk({}, finish_reason(gen, self.calls > 0), timings=timings_dict(gen))
        last["choices"][0]["stop_reason"] = gen.stop_reason
        if lps:
            last["choices"][0]["logprobs"] = {"content": lps}
        if gen.prompt_logprobs is not None:
            last["choices"][0]["prompt_logprobs"] = prompt_logprobs_json(self.served, gen.prompt_logprobs)
        yield last
        yield self._chunk(None, usage=usage_dict(gen, self.reasoning_tokens))

    async def response(self) -> dict:
        """The non-streaming chat.completion: the fold of chunks()."""
        content, reasoning, calls, lps, raw = [], [], {}, [], []
        finish, timings, usage, scored, stopped_by = "stop", {}, None, None, None
        async for chunk in self.chunks():
            if "error" in chunk:
                raise chunk_error(chunk)
            raw += chunk.get("raw_tokens", [])
            usage = chunk.get("usage", usage)
            for choice in chunk["choices"]:
                delta = choice["delta"]
                content.append(delta.get("content") or "")
                reasoning.append(delta.get("reasoning_content") or "")
                for tc in delta.get("tool_calls", []):
                    call = calls.setdefault(tc["index"], {"id": tc.get("id"), "type": "function",
                                                          "function": {"name": None, "arguments": ""}})
                    call["function"]["name"] = tc.get("function", {}).get("name") or call["function"]["name"]
                    call["function"]["arguments"] += tc.get("function", {}).get("arguments", "")
                lps += (choice.get("logprobs") or {}).get("content", [])
                finish = choice["finish_reason"] or finish
                scored = choice.get("prompt_logprobs", scored)
                stopped_by = choice.get("stop_reason", stopped_by)
            timings = chunk.get("timings", timings)
        text = "".join(content)
        message = {"role": "assistant", "content": None if calls and not text.strip() else text}
        if any(reasoning):
            message["reasoning_content"] = "".join(reasoning)
        if calls:
            message["tool_calls"] = [calls[i] for i in sorted(calls)]
        out = {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.served.name,
               "choices": [{"index": self.index, "message": message, "logprobs": {"content": lps} if lps else None,
                            "finish_reason": finish, "stop_reason": stopped_by,
                            **({"prompt_logprobs": scored} if scored is not None else {})}],
               "usage": usage, "timings": timings}
        if self.raw_tokens:
            out["raw_tokens"] = raw
        return out


class CompletionSession:
    """Raw /v1/completions: text deltas, legacy logprobs (tokens, token_logprobs, top_logprobs, text_offset).
    With echo the text starts with the prompt (its tokens' logprobs first, the first token's None)."""

    def __init__(self, served: ServedModel, handle: Handle, index: int = 0, first: "CompletionSession | None" = None,
                 echo: str | None = None, show_prompt_logprobs: bool = False, score_only: bool = False):
        """score_only: echo with max_tokens=0: the prompt (and its logprobs) alone, the token computed with it
        is not returned."""
        self.served, self.handle, self.index = served, handle, index
        self.echo, self.show_prompt_logprobs, self.score_only = echo, show_prompt_logprobs, score_only
        self.id = first.id if first else "cmpl-" + secrets.token_hex(12)
        self.created = first.created if first else int(time.time())

    def _chunk(self, text: str | None, finish: str | None = None, logprobs=None, **extra) -> dict:
        choices = [] if text is None else [{"index": self.index, "text": text, "logprobs": logprobs,
                                            "finish_reason": finish}]
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.served.name,
                "choices": choices, **extra}

    def _legacy(self, entries, offset: int) -> dict:
        """Legacy logprobs of (piece, logprob or None, [(id, logprob)] alternatives, text length) entries."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for piece, logprob, top, length in entries:
            out["tokens"].append(piece)
            out["token_logprobs"].append(finite(logprob))
            out["top_logprobs"].append(None if logprob is None else
                                       {self.served.piece(t): finite(v) for t, v in top or []} or None)
            out["text_offset"].append(offset)
            offset += length
        return out

    def _logprobs(self, events: list[TokenEvent], offset: int) -> dict | None:
        if not events or events[0].logprob is None:
            return None
        return self._legacy([(ev.piece, ev.logprob, ev.top_logprobs, len(ev.text)) for ev in events], offset)

    def _echo_logprobs(self, rows) -> dict:
        pieces = [self.served.piece(r.token_id) for r in rows]
        return self._legacy([(p, r.logprob, r.top, len(p)) for p, r in zip(pieces, rows)], 0)

    async def chunks(self) -> AsyncIterator[dict]:
        offset, started = 0, False
        try:
            async for ev in self.handle:
                if not started and self.echo is not None:  # the prompt first; its logprobs are in by the first token
                    rows = self.handle.gen.prompt_logprobs
                    scored = rows is not None and ev.logprob is not None
                    yield self._chunk(self.echo, logprobs=self._echo_logprobs(rows) if scored else None)
                    offset = len(self.echo)
                started = True
                if self.score_only:
                    continue
                # a chunk per token, as vLLM sends them, even where the text is held back (a character's first
                # bytes): clients time tokens by chunks (vLLM's bench counts each as one inter-token gap)
                yield self._chunk(ev.text, logprobs=self._logprobs([ev], offset))
                offset += len(ev.text)
        except (WorkerCrash, ServingError) as exc:
            if aborted(exc):
                yield self._chunk("", "abort")
            yield {"error": stream_error(exc)["error"]}
            return
        gen = self.handle.gen
        last = self._chunk("", "length" if self.score_only else finish_reason(gen, False), timings=timings_dict(gen))
        last["choices"][0]["stop_reason"] = None if self.score_only else gen.stop_reason
        if self.show_prompt_logprobs:
            last["choices"][0]["prompt_logprobs"] = prompt_logprobs_json(self.served, gen.prompt_logprobs)
        yield last
        usage = usage_dict(gen)
        if self.score_only:
            usage.update(completion_tokens=0, total_tokens=usage["prompt_tokens"])
        yield self._chunk(None, usage=usage)

    async def response(self) -> dict:
        """The non-streaming text_completion: the fold of chunks()."""
        text, logprobs, finish, timings, usage, scored, stopped_by = [], None, "stop", {}, None, None, None
        async for chunk in self.chunks():
            if "error" in chunk:
                raise chunk_error(chunk)
            usage, timings = chunk.get("usage", usage), chunk.get("timings", timings)
            for choice in chunk["choices"]:
                text.append(choice["text"])
                part = choice["logprobs"]
                if part:
                    logprobs = part if logprobs is None else {k: logprobs[k] + part[k] for k in logprobs}
                finish = choice["finish_reason"] or finish
                scored = choice.get("prompt_logprobs", scored)
                stopped_by = choice.get("stop_reason", stopped_by)
        choice = {"index": self.index, "text": "".join(text), "logprobs": logprobs, "finish_reason": finish,
                  "stop_reason": stopped_by}
        if self.show_prompt_logprobs:
            choice["prompt_logprobs"] = scored
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.served.name,
                "choices": [choice], "usage": usage, "timings": timings}
