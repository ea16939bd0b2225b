"""A chat session's chunks as Responses API events, and the response object they build.

Output items follow the model's order: a `reasoning` item for `<think>` text, a `message` item for the
answer, a `function_call` item per tool call. Each item is opened (`response.output_item.added`, and a
content part for text), filled by deltas (`response.reasoning_text.delta`, `response.output_text.delta`,
`response.function_call_arguments.delta`) and closed (the `.done` events, `response.output_item.done`)
when the next one starts or generation ends. A call's item opens the moment the tool-call parser seals the
call (its JSON complete), before later calls are generated. The stream starts with `response.created` and
`response.in_progress` and ends with `response.completed` (`response.incomplete` when max_output_tokens ran
out, `response.failed` on an engine error); the non-streaming response is the last event's response.

kvtool's extras, as the chat route has them: `timings` on the response object, and with `raw_tokens` every
generated token (`raw_tokens` on the response, and on the first delta event after each token).
"""

from __future__ import annotations

import secrets
import time
from typing import AsyncIterator

from kvtool.serving.responses_input import ResponsesRequest

TEXT_EVENTS = {"reasoning": ("reasoning_text", "response.reasoning_text"),
               "message": ("output_text", "response.output_text")}  # item type -> (part type, event prefix)


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def responses_usage(usage: dict | None) -> dict | None:
    """The chat usage in the Responses shape (input/output tokens; cached and reasoning tokens in details)."""
    if usage is None:
        return None
    details = usage.get("prompt_tokens_details") or {}
    return {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
            "total_tokens": usage["total_tokens"],
            "input_tokens_details": {"cached_tokens": details.get("cached_tokens", 0), "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": (usage.get("completion_tokens_details") or {}).get(
                "reasoning_tokens", 0)}}


class ResponseWriter:
    """One response: its events from a ChatSession's chunks (`events`), its object (`response`)."""

    def __init__(self, model: str, req: ResponsesRequest):
        self.req, self.model = req, model
        self.id, self.created = new_id("resp"), time.time()
        self.seq = 0
        self.output: list[dict] = []
        self.open: dict | None = None  # the item being written (the last of output)
        self.status, self.error, self.incomplete = "in_progress", None, None
        self.failure: dict | None = None  # the chat stream's error chunk, for a non-streaming response to raise
        self.usage: dict | None = None
        self.timings: dict | None = None
        self.raw: list[dict] = []
        self.pending_raw: list[dict] = []  # raw tokens not yet attached to an event

    def response(self) -> dict:
        req = self.req
        out = {"id": self.id, "object": "response", "created_at": self.created, "status": self.status,
               "completed_at": None if self.status == "in_progress" else time.time(), "model": self.model,
               "output": [dict(item) for item in self.output], "error": self.error,
               "incomplete_details": self.incomplete, "instructions": req.instructions,
               "max_output_tokens": req.max_output_tokens, "temperature": req.temperature, "top_p": req.top_p,
               "tools": req.tools or [], "tool_choice": req.tool_choice or "auto",
               "parallel_tool_calls": req.parallel_tool_calls, "previous_response_id": req.previous_response_id,
               "reasoning": req.reasoning, "text": req.text or {"format": {"type": "text"}}, "store": req.store,
               "metadata": req.metadata or {}, "user": req.user, "usage": responses_usage(self.usage),
               "timings": self.timings}
        if req.raw_tokens:
            out["raw_tokens"] = list(self.raw)
        return out

    def event(self, kind: str, **fields) -> dict:
        ev = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        if self.pending_raw and self.req.raw_tokens and kind.endswith(".delta"):
            ev["raw_tokens"], self.pending_raw = self.pending_raw, []
        return ev

    def _where(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.output) - 1}

    def _add(self, item: dict) -> list[dict]:
        out = self._close()
        self.output.append(item)
        self.open = item
        out.append(self.event("response.output_item.added", output_index=len(self.output) - 1, item=dict(item)))
        if item["type"] in TEXT_EVENTS:
            part = {"type": TEXT_EVENTS[item["type"]][0], "text": ""}
            if item["type"] == "message":
                part["annotations"] = []
            out.append(self.event("response.content_part.added", **self._where(), content_index=0, part=part))
        return out

    def _text(self, kind: str, delta: str) -> list[dict]:
        out = [] if self.open is not None and self.open["type"] == kind else self._add(
            {"id": new_id("msg" if kind == "message" else "rs"), "type": kind, "status": "in_progress",
             **({"role": "assistant", "content": []} if kind == "message" else {"summary": [], "content": []})})
        self.open["text"] = self.open.get("text", "") + delta
        extra = {"logprobs": []} if kind == "message" else {}
        out.append(self.event(f"{TEXT_EVENTS[kind][1]}.delta", **self._where(), content_index=0, delta=delta,
                              **extra))
        return out

    def _close(self) -> list[dict]:
        item, out = self.open, []
        if item is None:
            return out
        where = self._where()
        if item["type"] in TEXT_EVENTS:
            part_type, prefix = TEXT_EVENTS[item["type"]]
            text = item.pop("text", "")
            part = {"type": part_type, "text": text, **({"annotations": []} if part_type == "output_text" else {})}
            extra = {"logprobs": []} if part_type == "output_text" else {}
            out.append(self.event(f"{prefix}.done", **where, content_index=0, text=text, **extra))
            out.append(self.event("response.content_part.done", **where, content_index=0, part=part))
            item["content"] = [part]
        else:
            out.append(self.event("response.function_call_arguments.done", **where, name=item["name"],
                                  arguments=item["arguments"]))
        item["status"] = "incomplete" if self.incomplete else "completed"
        out.append(self.event("response.output_item.done", output_index=where["output_index"], item=dict(item)))
        self.open = None
        return out

    def _chunk_events(self, chunk: dict) -> list[dict]:
        out = []
        for choice in chunk["choices"]:
            delta = choice["delta"]
            if delta.get("reasoning_content"):
                out += self._text("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                out += self._text("message", delta["content"])
            for call in delta.get("tool_calls", []):
                if call.get("id"):
                    out += self._add({"id": new_id("fc"), "type": "function_call", "status": "in_progress",
                                      "call_id": call["id"], "name": call["function"]["name"], "arguments": ""})
                args = call.get("function", {}).get("arguments")
                if args:
                    self.open["arguments"] += args
                    out.append(self.event("response.function_call_arguments.delta", **self._where(), delta=args))
            if choice["finish_reason"] == "length":
                self.incomplete = {"reason": "max_output_tokens"}
        self.timings = chunk.get("timings", self.timings)
        self.usage = chunk.get("usage", self.usage)
        return out

    async def events(self, chunks: AsyncIterator[dict]) -> AsyncIterator[dict]:
        """Every event of the response; an engine error ends it with response.failed."""
        yield self.event("response.created", response=self.response())
        yield self.event("response.in_progress", response=self.response())
        async for chunk in chunks:
            if "error" in chunk:
                self.failure = chunk
                for ev in self._close():
                    yield ev
                self.status = "failed"
                self.error = {"code": chunk["error"].get("code") or "server_error",
                              "message": chunk["error"]["message"]}
                yield self.event("response.failed", response=self.response())
                return
            self.raw += chunk.get("raw_tokens", [])
            self.pending_raw += chunk.get("raw_tokens", [])
            for ev in self._chunk_events(chunk):
                yield ev
        for ev in self._close():
            yield ev
        self.status = "incomplete" if self.incomplete else "completed"
        yield self.event(f"response.{self.status}", response=self.response())
