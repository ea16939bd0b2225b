"""The OpenAI Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}.

Each request runs as the chat completion it is (`responses_input.chat_body`, then the chat route's own
rendering, tool-call parsing, structured output and worker), on any backend; its chunks become Responses
events (`responses_stream.ResponseWriter`). Streaming sends them as SSE (`event: TYPE`, `data: JSON`).

A stored response (`store`, the default) keeps its conversation as chat messages: instructions left out
(each request brings its own), the input and the output items rendered back as the turns they were. A
request with `previous_response_id` renders that conversation, then its own input, with the chat template,
so its prompt starts with the stored one's tokens and the prefix cache serves them (`cached_tokens`). The
store holds at most `ServerConfig.responses_store` responses; past that the oldest is dropped.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import AsyncIterator, Awaitable, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvtool.serving.errors import ServingError
from kvtool.serving.responses_input import ResponsesRequest, chat_body, input_messages
from kvtool.serving.responses_stream import ResponseWriter
from kvtool.serving.session import chunk_error, unenforced_headers


class ResponseNotFound(ServingError):
    status_code = 404


class ResponseStore:
    """Stored responses by id, oldest first: (the response object, its conversation as chat messages)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.items: OrderedDict[str, tuple[dict, list[dict]]] = OrderedDict()

    def put(self, body: dict, conversation: list[dict]) -> None:
        self.items[body["id"]] = (body, conversation)
        while len(self.items) > self.limit:
            self.items.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> tuple[dict, list[dict]]:
        if response_id not in self.items:
            raise ResponseNotFound(f"no stored response {response_id!r}: it was made with store=false, or it is "
                                   f"older than the {self.limit} responses this server keeps (--responses-store); "
                                   "send the whole conversation as input instead", param, code="response_not_found")
        return self.items[response_id]

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self.items[response_id]


def sse_events(events: AsyncIterator[dict], handles) -> AsyncIterator[str]:
    """Responses SSE framing; closing early (client gone) cancels generation."""
    async def frames():
        try:
            async for ev in events:
                yield f"event: {ev['type']}\ndata: {json.dumps(ev, ensure_ascii=False, separators=(',', ':'))}\n\n"
        finally:
            handles.cancel()

    return frames()


def responses_router(served, start_chat: Callable[..., Awaitable], until_done: Callable[..., Awaitable],
                     store_limit: int) -> APIRouter:
    """The routes; start_chat(body, request, raw_tokens, raw) -> (handles, sessions) is the chat route's start."""
    store = ResponseStore(store_limit)
    router = APIRouter()

    @router.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request):
        """A model response (OpenAI's Responses API), streamed with stream=true; kvtool adds timings and,
        with raw_tokens=true, every generated token."""
        history = []
        if body.previous_response_id is not None:
            history = store.get(body.previous_response_id, "previous_response_id")[1]
        chat, raw = chat_body(body, await request.json(), history)
        handles, sessions = await start_chat(chat, request, body.raw_tokens, raw)
        writer = ResponseWriter(served.name, body)
        unenforced = unenforced_headers(handles[0].gen.params)  # what a lenient schema left out, as on chat

        async def events():
            async for ev in writer.events(sessions[0].chunks()):
                if body.store and ev["type"] in ("response.completed", "response.incomplete"):
                    # stored before the client hears it is done: its next request may name it at once
                    out = ev["response"]
                    store.put(out, history + input_messages(body.input) + input_messages(out["output"], "output"))
                yield ev

        if body.stream:
            return StreamingResponse(sse_events(events(), handles), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **unenforced})

        async def fold() -> dict:
            async for _ in events():
                pass
            if writer.failure is not None:
                raise chunk_error(writer.failure)
            return writer.response()

        return JSONResponse(await until_done(request, handles, fold()), headers=unenforced)

    @router.get("/v1/responses/{response_id}")
    async def get_response(response_id: str):
        """A stored response, as POST /v1/responses returned it."""
        return store.get(response_id)[0]

    @router.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    return router
