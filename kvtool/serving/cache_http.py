"""HTTP endpoints for the prefix cache, as a FastAPI router the server includes.

    GET  /v1/cache         counters and sizes (PrefixCache.stats())
    POST /v1/cache/reset   drop every cached block and pin
    POST /v1/cache/pin     keep a prefix cached: {"messages": [...], "tools": [...]} (rendered with the
                           chat template, no generation prompt), {"prompt": "text"} or {"token_ids": [...]}
    POST /v1/cache/unpin   undo a pin; same body
    POST /v1/cache/save    write the cache to the server's --cache-file now (it is also written at shutdown)
    POST /v1/cache/edit    change a field of a cached prefix without recomputing it (kvtool.serving.cache_edit_http)
    GET  /v1/cache/tree    the cached prefixes as a tree of segments, each with its text (?max_chars=N, ?token_ids=true)

Errors are OpenAI-shaped: {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

from typing import Awaitable, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from kvtool.errors import ContextWindowError, InvalidParameterError, KvtoolError
from kvtool.serving.errors import error_from_exception
from kvtool.serving.limits import too_deep_message
from kvtool.serving.served import check_fits, check_prompt_text, check_strings


class CacheRequestError(KvtoolError):
    def __init__(self, message: str, param: str | None = None, status_code: int = 400,
                 code: str = "invalid_value", type_: str = "invalid_request_error"):
        super().__init__(message)
        self.param, self.status_code, self.code, self.type = param, status_code, code, type_


def error_response(exc: KvtoolError) -> JSONResponse:
    if not isinstance(exc, CacheRequestError):  # e.g. ModelNotFound, ContextWindowError: the server's own shape
        status, body = error_from_exception(exc)
        return JSONResponse(body, status_code=status)
    body = {"message": str(exc), "type": exc.type, "param": exc.param, "code": exc.code}
    return JSONResponse({"error": body}, status_code=exc.status_code)


def cache_router(get_manager: Callable[[], object], get_model: Callable[[], object] | None = None,
                 check_name: Callable[[str | None], None] | None = None, cache_file: str | None = None,
                 prefill: Callable[[list[int]], Awaitable[None]] | None = None) -> APIRouter:
    """Routes over ``get_manager()`` (a PrefixCache, or None when the cache is off). ``get_model()``
    returns the LoadedModel used to render messages and encode prompts for pin/unpin; ``check_name(model)``
    refuses a body's ``model`` that is not the served one (404, as every other route does); ``cache_file``
    is where /v1/cache/save writes (None: the route says how to set one); ``prefill(ids)`` caches a pin's
    KV before it is pinned (the server runs it as a request of the batch, so running streams keep going;
    None: pin() computes what is missing on the calling thread)."""
    router = APIRouter()

    def manager():
        cache = get_manager()
        if cache is None:
            raise CacheRequestError("the prefix cache is disabled on this server; start it with the prefix "
                                    "cache enabled (EngineConfig.enable_prefix_cache)", status_code=404,
                                    code="prefix_cache_disabled", type_="not_found_error")
        return cache

    @router.get("/v1/cache")
    def summary():
        try:
            return {"object": "prefix_cache", **manager().stats()}
        except KvtoolError as exc:
            return error_response(exc)

    @router.get("/v1/cache/tree")
    async def tree(max_chars: int = 200, token_ids: bool = False):
        try:
            cache = manager()
            if max_chars < 0:
                raise CacheRequestError(f"max_chars must be >= 0, got {max_chars}", param="max_chars")
            return await run_in_threadpool(describe_tree, cache, get_model, max_chars, token_ids)
        except KvtoolError as exc:
            return error_response(exc)

    @router.post("/v1/cache/reset")
    def reset():
        try:
            cache = manager()
            freed = cache.reset()
            return {"object": "prefix_cache.reset", **freed, "cache": cache.stats()}
        except KvtoolError as exc:
            return error_response(exc)

    @router.post("/v1/cache/save")
    async def save():
        try:
            cache = manager()
            if cache_file is None:
                raise CacheRequestError("this server has no cache file to save to; start it with --cache-file PATH "
                                        "(EngineConfig.cache_file)", status_code=404, code="no_cache_file",
                                        type_="not_found_error")
            model = get_model() if get_model is not None else None
            result = await run_in_threadpool(cache.save, cache_file, model)  # copying the KV: off the loop
            return {"object": "prefix_cache.save", **result, "cache": cache.stats()}
        except KvtoolError as exc:
            return error_response(exc)
        except OSError as exc:
            return error_response(CacheRequestError(f"could not write the cache file {cache_file}: {exc}",
                                                    status_code=500, code="cache_file_unwritable", type_="server_error"))

    async def pin_or_unpin(request: Request, action: str):
        try:
            cache = manager()
            body = await _json_object(request)
            if check_name is not None and body.get("model") is not None:
                if not isinstance(body["model"], str):
                    raise CacheRequestError("'model' must be a string (the served model's name)", param="model")
                check_name(body["model"])
            ids = await run_in_threadpool(token_ids_from_body, body, get_model, cache)  # tokenizing: off the loop
            if action == "pin":
                check_pin_fits(ids, get_model, cache)
                if prefill is not None:
                    await prefill(ids)
            result = await run_in_threadpool(getattr(cache, action), ids)
            return {"object": f"prefix_cache.{action}", **result, "cache": cache.stats()}
        except KvtoolError as exc:
            return error_response(exc)

    @router.post("/v1/cache/pin")
    async def pin(request: Request):
        return await pin_or_unpin(request, "pin")

    @router.post("/v1/cache/unpin")
    async def unpin(request: Request):
        return await pin_or_unpin(request, "unpin")

    return router


def describe_tree(cache, get_model, max_chars: int, token_ids: bool) -> dict:
    """The cache's tree (PrefixCache.tree) with each segment's text, cut to its first and last max_chars / 2
    (max_chars 0: no text)."""
    from kvtool.cache.tree import add_text, walk

    model = get_model() if get_model is not None else None
    tree = cache.tree()
    if model is not None and max_chars:
        add_text(tree, model.decode, max_chars)
    if not token_ids:
        for segment in walk(tree):
            del segment["token_ids"]
    return {"object": "prefix_cache.tree", "block_size": cache.block_size, "segments": sum(1 for _ in walk(tree)),
            "tree": tree}


async def _json_object(request: Request) -> dict:
    try:
        body = await request.json()
    except RecursionError:
        raise CacheRequestError(too_deep_message()) from None
    except Exception:
        raise CacheRequestError("the request body is not valid JSON; send an object such as "
                                '{"messages": [{"role": "system", "content": "..."}]}') from None
    if not isinstance(body, dict):
        raise CacheRequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def context_window(get_model, cache) -> int | None:
    model = get_model() if get_model is not None else None
    if model is not None:
        return model.context_window
    return cache.runner.spec.max_position if cache.runner is not None else None


def check_pin_fits(ids: list[int], get_model, cache) -> None:
    """A prefix no prompt can hold would be KV computed for nothing: refuse it before computing any."""
    window = context_window(get_model, cache)
    if window is not None and len(ids) >= window:
        raise ContextWindowError(f"pin: the prefix has {len(ids)} tokens; the model's context window is {window} "
                                 "tokens and a prompt must leave room for at least 1 new token, so no request could "
                                 f"use this prefix; pin at most {window - 1} tokens")


def token_ids_from_body(body: dict, get_model, cache) -> list[int]:
    """The token ids a pin/unpin body names: exactly one of messages (+ tools), prompt, token_ids."""
    given = [k for k in ("messages", "prompt", "token_ids") if body.get(k) is not None]
    if len(given) != 1:
        raise CacheRequestError(f"give exactly one of 'messages', 'prompt' or 'token_ids' (got "
                                f"{given or 'none'})", param=given[1] if len(given) > 1 else None)
    unknown = sorted(set(body) - {"messages", "tools", "prompt", "token_ids", "model"})
    if unknown:
        raise CacheRequestError(f"unknown field(s) {unknown}; expected messages/tools, prompt or token_ids",
                                param=unknown[0])
    if body.get("tools") is not None and given != ["messages"]:
        raise CacheRequestError("'tools' only goes with 'messages'", param="tools")
    if given == ["token_ids"]:
        ids = body["token_ids"]
        vocab = cache.runner.spec.vocab_size if cache.runner is not None else None
        if (not isinstance(ids, list) or not ids
                or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids)
                or (vocab is not None and any(t >= vocab for t in ids))):
            raise CacheRequestError(f"'token_ids' must be a non-empty list of ints in [0, {vocab or 'vocab'})",
                                    param="token_ids")
        return ids
    model = get_model() if get_model is not None else None
    if model is None:
        raise CacheRequestError(f"this server cannot tokenize '{given[0]}' for the cache; send 'token_ids'",
                                param=given[0])
    if given == ["prompt"]:
        if not isinstance(body["prompt"], str) or not body["prompt"]:
            raise CacheRequestError("'prompt' must be a non-empty string", param="prompt")
        check_prompt_text(model, body["prompt"], "prompt")
        return model.encode(body["prompt"])
    messages, tools = body["messages"], body.get("tools")
    if (not isinstance(messages, list) or not messages
            or any(not isinstance(m, dict) or not isinstance(m.get("role"), str) for m in messages)):
        raise CacheRequestError("'messages' must be a non-empty list of objects with a 'role'", param="messages")
    if tools is not None and (not isinstance(tools, list) or any(not isinstance(t, dict) for t in tools)):
        raise CacheRequestError("'tools' must be a list of tool objects", param="tools")
    check_strings(messages, "messages")  # a lone surrogate: the chat route's 400, not the tokenizer's TypeError
    check_strings(tools, "tools")
    try:
        text = model.render(messages, tools=tools, add_generation_prompt=False)
    except InvalidParameterError as exc:  # a template error names what is wrong with the messages
        raise CacheRequestError(str(exc), param="messages") from None
    check_fits(text, model.context_window, model.tokenizer)
    return model.encode_rendered(text)
