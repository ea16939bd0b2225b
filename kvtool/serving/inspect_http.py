"""The web inspector: GET /inspect (static page) and the JSON endpoints it needs.

    app.include_router(inspect_router(get_model, worker))

Endpoints: GET /v1/viz/config, POST /v1/viz/render, /v1/viz/tokens, /v1/viz/attention, and
POST /v1/viz/generate (SSE; used while the chat endpoint has no raw-token opt-in).
What runs the model goes through the server's worker: a generation is one more request of its batch (as
chat is), an attention pass runs on its thread between two steps (`Worker.run_exclusive`). Without a worker
the router makes its own Engine and Worker.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path
from typing import Any, Callable, Literal, Union

from fastapi import APIRouter
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, StreamingResponse
from pydantic import BaseModel, Field

from kvtool.errors import KvtoolError
from kvtool.serving.choices import sse
from kvtool.serving.errors import error_body, error_from_exception
from kvtool.serving.protocol import SEED_RANGE
from kvtool.serving.served import check_fits, check_prompt_text, check_strings
from kvtool.viz.config import VizConfig

log = logging.getLogger("kvtool.viz")

STATIC = Path(__file__).parents[1] / "viz" / "static"  # the page itself stays with the visualizer
ASSETS = {"inspect.js": "text/javascript", "inspect.css": "text/css"}
Index = Union[int, Literal["mean", "max"]]


class Conversation(BaseModel):
    messages: list[dict] | None = None
    tools: list[dict] | None = None
    prompt: str | None = None  # raw text instead of messages
    add_generation_prompt: bool = True


class TokensRequest(BaseModel):
    ids: list[int]
    n_prompt: int | None = None


class AttentionRequest(BaseModel):
    ids: list[int]
    query: int
    layer: Index = "mean"
    head: Index = "mean"


class GenerateRequest(Conversation):
    ids: list[int] | None = None  # token ids instead of messages/prompt
    max_tokens: int = VizConfig.inspect_max_tokens
    temperature: float = VizConfig.temperature
    top_p: float = 1.0
    seed: int | None = Field(default=None, **SEED_RANGE)  # the chat route's range (what torch can seed)


def error_response(exc: KvtoolError) -> JSONResponse:
    """The server's OpenAI-shaped error: {"error": {message, type, param, code}}."""
    status, body = error_from_exception(exc)
    return JSONResponse(body, status_code=status)


def conversation_ids(model, req: Conversation) -> tuple[list[int], str]:
    from kvtool.viz.inputs import parse_conversation, prompt_ids, render_conversation

    # lone surrogates and prompts too long for any context window: a 400 before the tokenizer sees them
    if req.messages is not None:
        messages, tools = parse_conversation({"messages": req.messages, "tools": req.tools})
        check_strings(messages, "messages")
        check_strings(tools, "tools")
        text = render_conversation(model, messages, tools, req.add_generation_prompt)
        check_fits(text, model.context_window, model.tokenizer)
        return model.encode_rendered(text), text
    if req.prompt is not None:
        check_prompt_text(model, req.prompt, "prompt")
    ids = prompt_ids(model, req.prompt)
    return ids, req.prompt or ""


def inspect_router(get_model: Callable[[], Any], worker=None, chat_stream: bool = False,
                   chat_raw_field: str = "raw_tokens") -> APIRouter:
    """get_model() -> LoadedModel; worker: the server's Worker (kvtool.serving.worker), which runs
    /v1/viz/generate as one more request of its batch (its engine's prefix cache makes cached_tokens real) and an
    attention pass between two steps; without one the router makes its own Engine and Worker on first use.
    chat_stream=True makes the page stream from /v1/chat/completions with `chat_raw_field: true`."""
    own: list = []
    own_lock = threading.Lock()

    def the_worker():
        if worker is not None:
            return worker
        with own_lock:
            if not own:
                from kvtool.engine import Engine
                from kvtool.serving.core import KvtoolCore
                from kvtool.serving.worker import Worker

                own.append(Worker(KvtoolCore(Engine(get_model()))))
            return own[0]

    router = APIRouter()

    @router.get("/inspect", response_class=HTMLResponse, include_in_schema=False)
    def page():
        return HTMLResponse((STATIC / "inspect.html").read_text())

    @router.get("/inspect/static/{name}", include_in_schema=False)
    def asset(name: str):
        if name not in ASSETS:
            return JSONResponse(error_body(404, f"no asset {name}"), status_code=404)
        return FileResponse(STATIC / name, media_type=ASSETS[name])

    @router.get("/v1/viz/config")
    def config():
        model = get_model()
        s = model.spec
        return {"model": model.name, "num_layers": s.num_layers, "num_heads": s.num_heads,
                "num_kv_heads": s.num_kv_heads, "context_window": model.context_window,
                "sliding_layers": s.sliding_layers, "sliding_window": s.sliding_window,
                "stream": "chat" if chat_stream else "viz", "chat_raw_field": chat_raw_field,
                "generate_url": "/v1/chat/completions" if chat_stream else "/v1/viz/generate",
                "default_max_tokens": VizConfig.inspect_max_tokens}

    @router.post("/v1/viz/render")
    def render(req: Conversation):
        from kvtool.viz.probs import check_ids
        from kvtool.viz.tokens import make_tokens

        try:
            model = get_model()
            ids, text = conversation_ids(model, req)
            check_ids(model, ids)
            return {"ids": ids, "text": text, "n_tokens": len(ids), "tokens": make_tokens(model, ids).records()}
        except KvtoolError as exc:
            return error_response(exc)

    @router.post("/v1/viz/tokens")
    def tokens(req: TokensRequest):
        from kvtool.viz.probs import check_ids
        from kvtool.viz.tokens import make_tokens

        try:
            model = get_model()
            ids = check_ids(model, req.ids)
            return {"n_tokens": len(ids), "tokens": make_tokens(model, ids, req.n_prompt).records()}
        except KvtoolError as exc:
            return error_response(exc)

    @router.post("/v1/viz/attention")
    def attention(req: AttentionRequest):
        from kvtool.viz.probs import attention_row

        try:
            model = get_model()
            row = the_worker().run_exclusive(lambda: attention_row(model, req.ids, req.query, req.layer, req.head))
        except KvtoolError as exc:
            return error_response(exc)
        top = sorted(range(len(row)), key=row.__getitem__, reverse=True)[:10]
        return {"query": req.query, "layer": req.layer, "head": req.head, "row": [round(p, 7) for p in row],
                "top": [[i, row[i]] for i in top]}

    @router.post("/v1/viz/generate")
    async def generate(req: GenerateRequest):
        from kvtool.config import SamplingParams
        from kvtool.viz.probs import check_ids
        from kvtool.viz.tokens import ChannelTracker

        try:
            model = get_model()
            if req.ids is not None:
                ids = check_ids(model, req.ids)  # before decoding: a negative id overflows the tokenizer
                text = model.decode(ids)
            else:  # rendering and tokenizing: off the event loop
                ids, text = await asyncio.to_thread(conversation_ids, model, req)
            params = SamplingParams(max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
                                    seed=req.seed).validate()
            handle = the_worker().submit(ids, params, False)  # validates; a 400 / 429 / 503 before the stream
        except KvtoolError as exc:
            return error_response(exc)
        return StreamingResponse(sse(_events(handle, ChannelTracker(text), len(ids)), handle, False),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return router


async def _events(handle, tracker, n_prompt: int):
    """The inspector's events for a request the worker runs in its batch: start, each token with its channel,
    done with the timings (or an error). kvtool.serving.choices.sse frames them and cancels the request of a client
    that leaves."""
    try:
        yield {"type": "start", "n_prompt": n_prompt}
        async for ev in handle:
            yield {"type": "token", "index": ev.index, "id": ev.token_id, "piece": ev.piece,
                   "channel": tracker.feed(ev.piece), "t_ms": round(ev.t_ms, 2)}
        yield {"type": "done", "finish_reason": handle.gen.finish_reason, "timings": handle.gen.timings.to_dict()}
    except KvtoolError as exc:  # the worker's 400 / 500 / 503 for this request
        yield {"type": "error", "message": str(exc)}
    except Exception as exc:  # whatever fails, the stream gets an error event and ends (never a silent [DONE])
        log.exception("viz generate failed")
        yield {"type": "error", "message": f"internal server error: {type(exc).__name__}: {exc}"}

