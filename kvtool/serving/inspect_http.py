"""The web inspector: GET /inspect (static page) and the JSON endpoints it needs.

    app.include_router(inspect_router(get_model, run_exclusive=worker.run_exclusive))

Endpoints: GET /v1/viz/config, POST /v1/viz/render, /v1/viz/tokens, /v1/viz/attention, and
POST /v1/viz/generate (SSE; used while the chat endpoint has no raw-token opt-in).
Everything that runs the model goes through `run_exclusive(fn) -> fn()`, which must hold the
model exclusively (the server's worker lock/queue); without one the router makes its own lock,
which is only safe when nothing else runs the model.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
from pathlib import Path
from typing import Any, Callable, Literal, Union

from fastapi import APIRouter
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, StreamingResponse
from pydantic import BaseModel, Field

from kvtool.errors import KvtoolError
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
        return model.encode(text), text
    if req.prompt is not None:
        check_prompt_text(model, req.prompt, "prompt")
    ids = prompt_ids(model, req.prompt)
    return ids, req.prompt or ""


def inspect_router(get_model: Callable[[], Any], run_exclusive: Callable[[Callable[[], Any]], Any] | None = None,
                   lock: threading.Lock | None = None, get_engine: Callable[[], Any] | None = None,
                   chat_stream: bool = False, chat_raw_field: str = "raw_tokens") -> APIRouter:
    """get_model() -> LoadedModel; run_exclusive(fn) runs fn holding the model (or pass `lock`);
    get_engine() -> the server's Engine (its prefix cache makes cached_tokens real; default: own Engine);
    chat_stream=True makes the page stream from /v1/chat/completions with `chat_raw_field: true`."""
    if run_exclusive is None:
        guard = lock or threading.Lock()

        def run_exclusive(fn):
            with guard:
                return fn()

    engines: dict[str, Any] = {}

    def engine():
        if get_engine is not None:
            return get_engine()
        if "own" not in engines:
            from kvtool.engine import Engine

            engines["own"] = Engine(get_model())
        return engines["own"]

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
            row = run_exclusive(lambda: attention_row(model, req.ids, req.query, req.layer, req.head))
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
            engine().check_prompt(ids, params)
        except KvtoolError as exc:
            return error_response(exc)
        events: queue.Queue = queue.Queue()
        cancel = threading.Event()

        def produce():
            tracker = ChannelTracker(text)
            gen = None
            try:
                gen = engine().generate(ids, params, skip_special_tokens=False)
                events.put({"type": "start", "n_prompt": len(ids)})
                for ev in gen:
                    events.put({"type": "token", "index": ev.index, "id": ev.token_id, "piece": ev.piece,
                                "channel": tracker.feed(ev.piece), "t_ms": round(ev.t_ms, 2)})
                    if cancel.is_set():
                        gen.close()
                        break
                events.put({"type": "done", "finish_reason": gen.finish_reason, "timings": gen.timings.to_dict()})
            except KvtoolError as exc:
                events.put({"type": "error", "message": str(exc)})

        def run():  # whatever fails, the stream gets an error event and ends (never a silent [DONE])
            try:
                run_exclusive(produce)
            except Exception as exc:
                log.exception("viz generate failed")
                events.put({"type": "error", "message": f"internal server error: {type(exc).__name__}: {exc}"})
            finally:
                events.put(None)

        threading.Thread(target=run, daemon=True, name="viz-generate").start()

        async def stream():
            try:
                while (item := await asyncio.to_thread(events.get)) is not None:
                    yield f"data: {json.dumps(item)}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                cancel.set()

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return router
