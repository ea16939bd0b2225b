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

from kvtool.config import EngineConfig, SamplingParams
from kvtool.engine import Engine
from kvtool.errors import InvalidParameterError, KvtoolError
from kvtool.models.fim import fim_format, plain_ids
from kvtool.serving.chat import prepare_chat
from kvtool.serving.choices import merged_chunks, merged_response
from kvtool.serving.config import ServerConfig
from kvtool.serving.errors import AuthError, ServingError, error_body, error_from_exception
from kvtool.serving.limits import BodyLimit, too_deep_message
from kvtool.serving.metrics import ServerMetrics
from kvtool.serving.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TemplateRequest,
                                     TokenizeRequest)
from kvtool.serving.served import ServedModel
from kvtool.serving.session import ChatSession, CompletionSession
from kvtool.serving.tokens import token_table
from kvtool.serving.toolparse import TOOL_FORMATS
from kvtool.serving.worker import Worker

log = logging.getLogger("kvtool.serving")
UNION_BRANCH = re.compile(r"^(str|int|float|bool|none|list\[.*|dict\[.*|literal\[.*|function-.*|[A-Z]\w*)$")


def sse_line(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def sse(chunks, handle, include_usage: bool):
    """SSE framing; the usage chunk only when asked; closing early (client gone) cancels generation."""
    try:
        async for chunk in chunks:
            if "choices" in chunk:  # an OpenAI chunk (the raw token stream sends plain events)
                if not chunk["choices"] and "usage" in chunk and not include_usage:
                    continue
                if include_usage:
                    chunk.setdefault("usage", None)
            yield sse_line(chunk)
        yield "data: [DONE]\n\n"
    finally:
        handle.cancel()


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


def mount_skills(engine: Engine, served: ServedModel, prefix_cache, catalog=None):
    """Install a SkillSplicer around the prefix cache when EngineConfig.skills_dir (or a catalog) is given."""
    folder = engine.config.skills_dir
    if catalog is None and not folder:
        return None
    from kvtool.skills.catalog import load_catalog
    from kvtool.skills.splice import SkillSplicer

    if catalog is None:
        catalog = load_catalog(folder, engine.model, preamble=engine.config.skill_preamble)
    splicer = SkillSplicer(catalog, engine.config.skill_repair, inner=prefix_cache, chunk=engine.config.prefill_chunk)
    engine.prefix_cache, served.skills = splicer, catalog
    log.info("serving %d skills (%s), repair %s", len(catalog), ", ".join(catalog.names()), engine.config.skill_repair)
    return splicer


def save_cache_file(prefix_cache, path: str | None, model, what: str = "saved") -> bool:
    """Write the prefix cache to --cache-file (at shutdown, and by --cache-save-every), so the next start answers
    known prefixes from it; a failure is logged, not raised (shutting down or serving on anyway)."""
    if prefix_cache is None or path is None:
        return False
    try:
        info = prefix_cache.save(path, model)
    except Exception as exc:
        log.error("could not %s the prefix cache to %s: %s: %s", what.removesuffix("d"), path, type(exc).__name__, exc)
        return False
    log.info("%s the prefix cache to %s: %d tokens, %d pins", what, path, info["tokens"], info["pins"])
    return True


async def autosave(prefix_cache, path: str, model, every: float) -> None:
    """--cache-save-every: save the prefix cache to ``path`` every ``every`` seconds when it changed since the
    last save. A failed save is logged and tried again at the next tick; serving goes on either way."""
    saved = prefix_cache.changes
    while True:
        await asyncio.sleep(every)
        changes = prefix_cache.changes
        if changes != saved and await run_in_threadpool(save_cache_file, prefix_cache, path, model, "autosaved"):
            saved = changes


def create_app(model, engine_config: EngineConfig | None = None, server_config: ServerConfig | None = None,
               prefix_cache=None, skills=None) -> FastAPI:
    """The app; `skills` is a SkillCatalog to serve (else EngineConfig.skills_dir is loaded, if set)."""
    cfg = (server_config or ServerConfig()).validate()  # names an unknown tool parser too
    fmt = TOOL_FORMATS[cfg.tool_parser]
    served = ServedModel(model, cfg.served_model_name)
    engine = Engine(model, engine_config, prefix_cache)
    if prefix_cache is None:  # one prefix cache for every request, unless EngineConfig turns it off
        from kvtool.cache.manager import attach_prefix_cache

        prefix_cache = attach_prefix_cache(engine)
    splicer = mount_skills(engine, served, prefix_cache, skills)
    extra = [f for f in (cfg.extra_metrics, prefix_cache and prefix_cache.prometheus_lines) if f]
    metrics = ServerMetrics((lambda: [line for f in extra for line in f()]) if extra else None)
    worker = Worker(engine, cfg.max_active, cfg.max_queue, metrics, cfg.prefill_budget, cfg.kv_bytes)
    started = int(time.time())
    if cfg.cache_save_every is not None and (prefix_cache is None or engine.config.cache_file is None):
        raise InvalidParameterError("--cache-save-every saves the prefix cache to --cache-file; give a cache file "
                                    "(EngineConfig.cache_file) with the prefix cache on")

    @asynccontextmanager
    async def lifespan(app):
        saver = cfg.cache_save_every and asyncio.create_task(
            autosave(prefix_cache, engine.config.cache_file, model, cfg.cache_save_every))
        yield
        if saver:  # a save in progress finishes first (its thread can't be stopped), so the last save wins
            saver.cancel()
            await asyncio.gather(saver, return_exceptions=True)
        worker.stop()
        save_cache_file(prefix_cache, engine.config.cache_file, model)

    app = FastAPI(title="kvtool serve", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible server that also shows the raw tokens and the chat template.")
    app.state.served, app.state.worker, app.state.metrics, app.state.config = served, worker, metrics, cfg

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
        body = {"status": "ok" if worker.alive else "stopped", "model": served.name, "running": worker.running,
                "waiting": worker.waiting}
        return JSONResponse(body, status_code=200 if worker.alive else 503)

    @app.get("/metrics", response_class=PlainTextResponse)
    async def prometheus():
        sched = worker.scheduler
        return PlainTextResponse(metrics.render(worker.running, worker.waiting, sched),
                                 media_type="text/plain; version=0.0.4")

    @api.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served.name, "object": "model", "created": started,
                                            "owned_by": "kvtool", "max_model_len": served.context_window,
                                            "precision": served.precision}]}

    @api.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        handles, sessions = await start_chat(body, request, body.raw_tokens)
        if body.stream:
            return StreamingResponse(sse(merged_chunks(sessions, body.n), handles, body.include_usage),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return JSONResponse(await until_done(request, handles, merged_response(sessions, body.n)))

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

        return StreamingResponse(sse(events(), handles, True), media_type="text/event-stream")

    async def start_chat(body: ChatCompletionRequest, request: Request, raw_tokens: bool):
        served.check_name(body.model)
        params = body.chat_sampling(cfg.default_max_tokens)
        # rendering and tokenizing run off the event loop (check_fits already bounds how long they take)
        prepared = await run_in_threadpool(prepare_chat, served, body, await request.json(), fmt)
        if prepared.call_schema is not None:  # a forced call: its JSON follows the tool's schema
            if params.response_format != "text" or params.choice is not None or params.regex is not None:
                raise ServingError("response_format (or a choice or regex) cannot be combined with tool_choice "
                                   "'required' or a named function: the call's JSON already follows the tool's "
                                   "schema", "response_format")
            params = dataclasses.replace(params, response_format="json_schema", json_schema=prepared.call_schema,
                                         json_suffix=prepared.call_suffix).validate()
        handles = worker.submit_choices([prepared.prompt_ids], body.n, params)
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
            ids = await run_in_threadpool(lambda: [served.encode(p, add_special_tokens=True) if isinstance(p, str)
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
        handles = worker.submit_choices(ids, body.n, params)
        sessions: list[CompletionSession] = []
        for i, handle in enumerate(handles):
            prompt = prompts[i // body.n]
            echo = (prompt if isinstance(prompt, str) else served.decode(prompt)) if body.echo else None
            sessions.append(CompletionSession(served, handle, i, sessions[0] if sessions else None, echo,
                                              body.prompt_logprobs is not None))
        if body.stream:
            return StreamingResponse(sse(merged_chunks(sessions, body.n), handles, body.include_usage),
                                     media_type="text/event-stream")
        return JSONResponse(await until_done(request, handles, merged_response(sessions, body.n)))

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

    @api.get("/v1/skills")
    async def list_skills():
        """The skills this server splices (kvtool serve --skills DIR); request them with the `skills` field."""
        if splicer is None:
            return {"object": "list", "data": [], "enabled": False}
        from kvtool.skills.repair import describe

        return {"object": "list", "enabled": True, "render": served.skills.render, "repair": describe(splicer.repair),
                "data": [{"object": "skill", **row} for row in served.skills.summary()]}

    @api.get("/v1/chat/template")
    async def raw_template():
        if not model.chat_template:
            raise ServingError(f"model {served.name} has no chat template", code="no_chat_template")
        return {"model": served.name, "chat_template": model.chat_template}

    app.include_router(api)
    from kvtool.cache.http import cache_router

    async def prefill_in_batch(ids: list[int]) -> None:  # a pin's KV, chunked beside the running streams
        async for _ in worker.submit(ids, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)):
            pass

    cache_routes = cache_router(lambda: prefix_cache, lambda: model, served.check_name, engine.config.cache_file,
                                prefill_in_batch)
    app.include_router(cache_routes, dependencies=[Depends(check_key)])
    from kvtool.cache.edit_http import edit_router

    app.include_router(edit_router(lambda: prefix_cache, lambda: model, served.check_name, worker.run_exclusive),
                       dependencies=[Depends(check_key)])
    app.state.prefix_cache = prefix_cache
    from kvtool.viz.inspect import inspect_router

    app.include_router(inspect_router(lambda: model, run_exclusive=worker.run_exclusive, get_engine=lambda: engine,
                                      chat_stream=True), dependencies=[Depends(check_key)])
    routes = {r.path for r in [*app.routes, *api.routes] if hasattr(r, "path")}
    app.add_middleware(BodyLimit, max_bytes=cfg.max_body_bytes)
    app.add_middleware(MetricsMiddleware, metrics=metrics, routes=routes)  # outermost: it counts the 413s too
    return app
