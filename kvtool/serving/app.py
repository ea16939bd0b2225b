"""`create_app(model)`: the FastAPI app. Routes validate, queue and stream; the worker computes.

Every error a client can cause is an OpenAI-shaped JSON error with a 4xx status; an
unexpected fault is a 500 in the same shape, and the server keeps serving either way.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import secrets
import time
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvtool.config import EngineConfig
from kvtool.errors import InvalidParameterError, KvtoolError
from kvtool.models.fim import fim_format, plain_ids
from kvtool.serving.chat import prepare_chat
from kvtool.serving.choices import merged_chunks, merged_response, sse
from kvtool.serving.config import ServerConfig
from kvtool.serving.errors import AuthError, ServingError, error_body, error_from_exception
from kvtool.serving.limits import BodyLimit, too_deep_message
from kvtool.serving.llama_http import llama_router
from kvtool.serving.metrics import ServerMetrics
from kvtool.serving.openapi import install_docs
from kvtool.serving.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TemplateRequest,
                                     TokenizeRequest)
from kvtool.serving.responses import responses_router
from kvtool.serving.served import ServedModel
from kvtool.serving.session import ChatSession, CompletionSession, unenforced_headers
from kvtool.serving.shutdown import Drain, DrainMiddleware
from kvtool.serving.tokens import token_table
from kvtool.serving.toolparse import TOOL_FORMATS

log = logging.getLogger("kvtool.serving")
UNION_BRANCH = re.compile(r"^(str|int|float|bool|none|list\[.*|dict\[.*|literal\[.*|function-.*|[A-Z]\w*)$")


async def until_done(request: Request, handle, awaitable):
    """Await a non-streaming result; a client that disconnects first cancels its generation."""
    async def watch():
        while (await request.receive())["type"] != "http.disconnect":
            await asyncio.sleep(0.05)  # (only other message type here: trailing body chunks)
        handle.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        return await awaitable
    finally:
        watcher.cancel()
        handle.cancel()


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    first = errors[0] if errors else {"msg": "invalid request", "loc": ()}
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}", None
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if not loc:
        return ("the request body must be a JSON object (send it with Content-Type: application/json)", None)
    # pydantic names union branches in loc ("str", "list[int]", "NamedToolChoice"); keep the field path
    where = ".".join(p for p in loc if not UNION_BRANCH.match(p)) or ".".join(loc)
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return f"invalid request: {where}: {first['msg']}{more}", where


class MetricsMiddleware:
    """Counts responses by route and status (pure ASGI, so streaming is untouched)."""

    def __init__(self, app, metrics: ServerMetrics, routes: set[str]):
        self.app, self.metrics, self.routes = app, metrics, routes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            self.metrics.http_response(scope["path"] if scope["path"] in self.routes else "other", status[0])


def create_app(model, engine_config: EngineConfig | None = None, server_config: ServerConfig | None = None,
               prefix_cache=None, skills=None, backend=None) -> FastAPI:
    """The app; `skills` is a SkillCatalog to serve (else EngineConfig.skills_dir is loaded, if set).

    backend: what computes (default: kvtool's own engine, a KvtoolBackend; kvtool.integrations.vllm gives a
    VllmBackend); the routes here are the same for every backend."""
    cfg = (server_config or ServerConfig()).validate()  # names an unknown tool parser too
    fmt = TOOL_FORMATS[cfg.tool_parser]
    served = ServedModel(model, cfg.served_model_name)
    if backend is None:
        from kvtool.serving.backend import KvtoolBackend

        backend = KvtoolBackend(model, served, engine_config, prefix_cache, skills, cfg)
    served.engine = backend.name
    extra = [f for f in (cfg.extra_metrics, backend.metrics_lines) if f]
    metrics = ServerMetrics((lambda: [line for f in extra for line in f()]) if extra else None)
    worker = backend.start_worker(metrics)
    started = int(time.time())
    drain = Drain(worker, cfg.shutdown_timeout)

    @asynccontextmanager
    async def lifespan(app):
        drain.loop = asyncio.get_running_loop()
        await backend.on_start()
        yield
        await backend.on_stop()

    app = FastAPI(title="kvtool serve", version="0.1.0", lifespan=lifespan, openapi_url=None, docs_url=None,
                  redoc_url=None,
                  description="OpenAI-compatible server that also shows the raw tokens and the chat template.")
    app.state.served, app.state.worker, app.state.metrics, app.state.config = served, worker, metrics, cfg
    app.state.drain = drain

    def check_key(request: Request) -> None:
        if cfg.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {cfg.api_key}".encode()):
            raise AuthError("missing or wrong API key: send the header 'Authorization: Bearer <key>' with the key "
                            "kvtool serve was started with", code="invalid_api_key")

    api = APIRouter(dependencies=[Depends(check_key)])

    @app.exception_handler(KvtoolError)
    async def kvtool_error(request: Request, exc: KvtoolError):
        status, body = error_from_exception(exc)
        headers = {"Retry-After": "1"} if status in (429, 503) else None
        return JSONResponse(body, status_code=status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError):
        message, param = validation_message(exc)
        return JSONResponse(error_body(400, message, param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}; see /docs for the API"
        elif isinstance(exc.__cause__, RecursionError):  # FastAPI's "error parsing the body"
            message = too_deep_message()
        return JSONResponse(error_body(exc.status_code, message), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def server_fault(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return JSONResponse(error_body(500, f"internal server error: {type(exc).__name__}: {exc}"), status_code=500)

    @app.get("/health")
    async def health():
        status = "draining" if drain.draining else "ok" if worker.alive else "stopped"
        body = {"status": status, "model": served.name, "running": worker.running, "waiting": worker.waiting}
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    open_paths = {"/health"} | ({"/metrics"} if cfg.metrics_open else set())

    @app.get("/metrics", response_class=PlainTextResponse,
             dependencies=[] if cfg.metrics_open else [Depends(check_key)])
    async def prometheus():
        return PlainTextResponse(metrics.render(worker.running, worker.waiting, worker.scheduler),
                                 media_type="text/plain; version=0.0.4")

    @api.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served.name, "object": "model", "created": started,
                                            "owned_by": "kvtool", "max_model_len": served.context_window,
                                            "precision": served.precision, "engine": backend.name,
                                            "sampling_defaults": model.sampling_defaults.as_dict()}]}

    @api.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        handles, sessions = await start_chat(body, request, body.raw_tokens)
        headers = unenforced_headers(handles[0].gen.params)
        if body.stream:
            return StreamingResponse(sse(merged_chunks(sessions, body.n), handles, body.include_usage),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})
        return JSONResponse(await until_done(request, handles, merged_response(sessions, body.n)), headers=headers)

    @api.post("/v1/chat/completions/raw")
    async def chat_raw_tokens(body: ChatCompletionRequest, request: Request):
        """Every generated token as an SSE event {id, piece, channel, t_ms} (+ index for n > 1), then a summary
        (per choice for n > 1), then [DONE]."""
        handles, sessions = await start_chat(body, request, True)

        async def events():
            summary, ends = {"done": True}, []
            async for chunk in merged_chunks(sessions, body.n):
                if "error" in chunk:
                    yield chunk
                    return
                for token in chunk.get("raw_tokens", []):
                    yield token
                for choice in chunk["choices"]:
                    if choice["finish_reason"]:
                        ends.append({"index": choice["index"], "finish_reason": choice["finish_reason"],
                                     "stop_reason": choice.get("stop_reason"), "timings": chunk.get("timings")})
                if "usage" in chunk:
                    summary["usage"] = chunk["usage"]
            if body.n == 1:
                summary.update({k: v for k, v in ends[0].items() if k != "index"} if ends else {})
            else:
                summary["choices"] = sorted(ends, key=lambda e: e["index"])
            yield summary

        return StreamingResponse(sse(events(), handles, True), media_type="text/event-stream",
                                 headers=unenforced_headers(handles[0].gen.params))

    async def start_chat(body: ChatCompletionRequest, request: Request, raw_tokens: bool, raw: dict | None = None):
        """raw: the body's JSON (default: the request's; the Responses route passes the chat body it made)."""
        served.check_name(body.model)
        params = body.chat_sampling(cfg.default_max_tokens)
        # rendering and tokenizing run off the event loop (check_fits already bounds how long they take)
        raw = await request.json() if raw is None else raw
        prepared = await run_in_threadpool(prepare_chat, served, body, raw, fmt)
        if prepared.call_schema is not None:  # a forced call: its JSON follows the tool's schema
            if params.structured:
                raise ServingError("response_format (or a choice, regex or grammar) cannot be combined with "
                                   "tool_choice 'required' or a named function: the call's JSON already follows "
                                   "the tool's schema", "response_format")
            params = dataclasses.replace(params, response_format="json_schema", json_schema=prepared.call_schema,
                                         json_suffix=prepared.call_suffix, strict=prepared.call_strict).validate()
        handles = await worker.enqueue([prepared.prompt_ids], body.n, params)
        sessions: list[ChatSession] = []
        for i, handle in enumerate(handles):
            sessions.append(ChatSession(served, prepared, handle, fmt, raw_tokens, body.parallel_tool_calls, i,
                                        sessions[0] if sessions else None))
            sessions[-1].tag_raw = len(handles) > 1
        return handles, sessions

    @api.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        served.check_name(body.model)
        params = body.completion_sampling(cfg.default_max_tokens)
        prompts = body.prompt if isinstance(body.prompt, list) and body.prompt and isinstance(
            body.prompt[0], (str, list)) else [body.prompt]  # several prompts: choice p * n + i is choice i of p
        if body.suffix is None:
            ids = await run_in_threadpool(lambda: [served.encode(p, body.add_special_tokens) if isinstance(p, str)
                                                   else list(p) for p in prompts])
        else:  # fill in the middle: [PRE] prompt [SUF] suffix [MID], ended by a FIM stop token
            try:
                fim = fim_format(served.tokenizer, f"model {served.name}")
            except InvalidParameterError as exc:
                raise ServingError(str(exc), "suffix") from None
            served.check_prompt_text(body.suffix, "suffix")
            for p in prompts:
                if isinstance(p, str):
                    served.check_prompt_text(p + body.suffix, "prompt")

            def fim_ids():
                suffix = plain_ids(served.tokenizer, body.suffix)
                return [fim.prompt(plain_ids(served.tokenizer, p) if isinstance(p, str) else list(p), suffix)
                        for p in prompts]

            ids = await run_in_threadpool(fim_ids)
            params = fim.sampling(params)
        handles = await worker.enqueue(ids, body.n, params)
        sessions: list[CompletionSession] = []
        for i, handle in enumerate(handles):
            prompt = prompts[i // body.n]
            echo = (prompt if isinstance(prompt, str) else served.decode(prompt)) if body.echo else None
            sessions.append(CompletionSession(served, handle, i, sessions[0] if sessions else None, echo,
                                              body.prompt_logprobs is not None, body.score_only))
        headers = unenforced_headers(params)
        if body.stream:
            return StreamingResponse(sse(merged_chunks(sessions, body.n), handles, body.include_usage),
                                     media_type="text/event-stream", headers=headers)
        return JSONResponse(await until_done(request, handles, merged_response(sessions, body.n)), headers=headers)

    @api.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request):
        served.check_name(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ServingError("send exactly one of prompt (raw text) or messages (chat)", "prompt")
        if body.prompt is not None:
            add = True if body.add_special_tokens is None else body.add_special_tokens
            ids = await run_in_threadpool(served.encode, body.prompt, add)
        else:
            prepared = await run_in_threadpool(prepare_chat, served, body, await request.json(), fmt, False)
            ids = prepared.prompt_ids
        out = {"count": len(ids), "max_model_len": served.context_window, "tokens": ids,
               "token_strs": served.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None}
        if body.with_pieces:
            out["pieces"] = served.pieces(ids)
        return out

    @api.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        served.check_name(body.model)
        out = {"prompt": served.decode(body.tokens)}
        if body.with_pieces:
            out["pieces"] = served.pieces(body.tokens)
        return out

    @api.post("/v1/chat/template")
    async def render_template(body: TemplateRequest, request: Request):
        """The exact prompt chat completions would run: text, ids, and each token's piece and flags."""
        served.check_name(body.model)
        prepared = await run_in_threadpool(prepare_chat, served, body, await request.json(), fmt, False)
        return {"model": served.name, "prompt": prepared.prompt, "prefill": prepared.prefill,
                "call_schema": prepared.call_schema,
                "count": len(prepared.prompt_ids), "token_ids": prepared.prompt_ids,
                "tokens": token_table(served, prepared.prompt, prepared.prompt_ids)}

    @api.get("/v1/chat/template")
    async def raw_template():
        if not model.chat_template:
            raise ServingError(f"model {served.name} has no chat template", code="no_chat_template")
        return {"model": served.name, "chat_template": model.chat_template}

    api.include_router(responses_router(served, start_chat, until_done, cfg.responses_store))
    api.include_router(llama_router(worker, served, cfg.default_max_tokens, until_done))  # llama.cpp's /completion
    app.include_router(api)
    for router in backend.routers(worker, served):
        app.include_router(router, dependencies=[Depends(check_key)])
    install_docs(app, check_key, cfg.api_key is not None, open_paths)
    app.state.prefix_cache = getattr(backend, "prefix_cache", None)
    routes = {r.path for r in [*app.routes, *api.routes] if hasattr(r, "path")}
    app.add_middleware(BodyLimit, max_bytes=cfg.max_body_bytes)
    app.add_middleware(DrainMiddleware, drain=drain)
    app.add_middleware(MetricsMiddleware, metrics=metrics, routes=routes)  # outermost: it counts the 413s too
    return app
