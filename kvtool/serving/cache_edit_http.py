"""POST /v1/cache/edit: change a field of a cached (pinned) prefix without recomputing it (kvtool.skills.edit).

Body: the prefix as /v1/cache/pin takes it ({"messages": [...], "tools": [...]}, {"prompt": "..."} or
{"token_ids": [...]}), then
    "field": "Beijing"           the field's text, found once in the rendered prefix, or
    "span": [start, end]         its span, in "unit": "chars" (of the rendered text, the default) or "tokens";
    "new_value": "Shanghai"      (for a token span, with its leading space)
    "way": "erratum"             erratum | field_only | recompute_deviation:ratio=R | full
    "erratum": "..."             the correction's text (default: "Correction: where the conversation above ...",
                                 or "Correction: {label} is {new}, not {old}." with "label")
    "unpin_old": false           also unpin the old prefix
The prefix's KV comes from the cache (it must be cached: pin it first); the edited context's KV goes back into
the cache, pinned. The reply names the edited context's tokens: an in-place way keeps the token count (the
next request sends the messages with the new value); the erratum adds a user turn with the correction after
the prefix (the next request sends it as a message). That request's usage.prompt_tokens_details.cached_tokens
shows what was reused. recompute_attended needs the question, which a cache edit does not have.
"""

from __future__ import annotations

from typing import Callable

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from kvtool.errors import KvtoolError
from kvtool.serving.cache_http import CacheRequestError, _json_object, error_response, token_ids_from_body
from kvtool.skills.edit import EditInputError, apply_edit, erratum_text, find_field, parse_way, plan_edit, user_turn_ids

CONTEXT_KEYS = ("messages", "tools", "prompt", "token_ids", "model")
EDIT_KEYS = ("field", "span", "unit", "new_value", "way", "erratum", "label", "unpin_old")


def edit_router(get_manager: Callable[[], object], get_model: Callable[[], object],
                check_name: Callable[[str | None], None] | None = None,
                run_exclusive: Callable[[Callable], object] | None = None) -> APIRouter:
    """The route over get_manager() (a PrefixCache or None); run_exclusive(fn) runs fn holding the model."""
    router = APIRouter()

    @router.post("/v1/cache/edit")
    async def edit(request: Request):
        try:
            cache = get_manager()
            if cache is None:
                raise CacheRequestError("the prefix cache is disabled on this server; an edit needs a cached prefix",
                                        status_code=404, code="prefix_cache_disabled", type_="not_found_error")
            body = await _json_object(request)
            if check_name is not None and body.get("model") is not None:
                if not isinstance(body["model"], str):
                    raise CacheRequestError("'model' must be a string (the served model's name)", param="model")
                check_name(body["model"])
            unknown = sorted(set(body) - set(CONTEXT_KEYS) - set(EDIT_KEYS))
            if unknown:
                raise CacheRequestError(f"unknown field(s) {unknown}; an edit takes the prefix (messages/tools, "
                                        f"prompt or token_ids) and {', '.join(EDIT_KEYS)}", param=unknown[0])
            context = {k: body[k] for k in CONTEXT_KEYS if k in body}
            ids = await run_in_threadpool(token_ids_from_body, context, get_model, cache)
            plan = await run_in_threadpool(_plan, body, ids, get_model())
            run = (lambda: _apply(cache, get_model(), ids, *plan)) if run_exclusive is None else \
                (lambda: run_exclusive(lambda: _apply(cache, get_model(), ids, *plan)))
            return await run_in_threadpool(run)
        except EditInputError as exc:
            return error_response(CacheRequestError(str(exc), param=exc.param))
        except KvtoolError as exc:
            return error_response(exc)

    return router


def _plan(body: dict, ids: list[int], model):
    """Everything checked before any KV is touched: (edit, way, erratum ids, erratum text)."""
    unit = body.get("unit", "chars")
    text = None
    if body.get("prompt") is not None:
        text = body["prompt"]
    elif body.get("messages") is not None:
        text = model.render(body["messages"], tools=body.get("tools"), add_generation_prompt=False)
    if "new_value" not in body:
        raise EditInputError("give 'new_value', the field's new text", param="new_value")
    if ("field" in body) == ("span" in body):
        raise EditInputError("give exactly one of 'field' (the field's text) or 'span' ([start, end])", param="field")
    if "field" in body:
        if text is None:
            raise EditInputError("'field' is searched in the rendered text; with 'token_ids' give 'span' and "
                                 "'unit': 'tokens'", param="field")
        if unit != "chars":
            raise EditInputError("'field' gives a character span; leave out 'unit' or use 'span'", param="unit")
        span = find_field(text, body["field"])
    else:
        span = body["span"]
        if not isinstance(span, list) or len(span) != 2 or any(isinstance(v, bool) or not isinstance(v, int)
                                                                for v in span):
            raise EditInputError(f"'span' must be [start, end] (two integers), got {span!r}", param="span")
    if unit == "chars" and text is None:
        raise EditInputError("a character span needs the text ('messages' or 'prompt'); with 'token_ids' use "
                             "'unit': 'tokens'", param="unit")
    edit = plan_edit(model, text if unit == "chars" else ids, span, body["new_value"], unit)
    if edit.old_ids != ids:
        raise EditInputError("the rendered text does not tokenize to the prefix's tokens; give 'token_ids' and a "
                             "token span", param="span")
    way = body.get("way", "erratum")
    kind, _ = parse_way(way)
    if kind == "recompute_attended":
        raise EditInputError("recompute_attended ranks tokens by the attention of the question after the context, "
                             "which a cache edit does not have; use recompute_deviation:ratio=R", param="way")
    if kind not in ("full", "erratum"):
        edit.require_in_place(way)
    if not isinstance(body.get("unpin_old", False), bool):
        raise EditInputError("'unpin_old' must be true or false", param="unpin_old")
    note = None
    if kind == "erratum":
        label = body.get("label")
        if label is not None and not isinstance(label, str):
            raise EditInputError("'label' must be a string", param="label")
        note = body.get("erratum") or erratum_text(edit.old_value, edit.new_value, label)
        if not isinstance(note, str):
            raise EditInputError("'erratum' must be a string", param="erratum")
    return edit, way, (user_turn_ids(model, note) if note else None), note, body.get("unpin_old", False)


def _apply(cache, model, ids: list[int], edit, way: str, erratum_ids, note, unpin_old: bool) -> dict:
    runner, bs = model.runner, cache.block_size
    kv, cached, handle = cache.prepare(ids, runner)  # holds the cached blocks of ids[:-1] while we read them
    try:
        if cached < (len(ids) - 1) // bs * bs:
            raise CacheRequestError(f"the prefix is not cached ({cached} of its {len(ids)} tokens are); pin it with "
                                    "POST /v1/cache/pin first, then edit it", status_code=409, code="not_cached",
                                    param="messages")
        runner.prefill(ids[cached:], kv, logits="none")  # the last, partial block is never stored
    finally:
        cache.commit(handle, ids, kv)
    result = apply_edit(runner, kv, edit, way, erratum_ids)
    new = result.token_ids
    full = len(new) // bs * bs
    cache.import_chain(new, lambda i: result.cache.stacked(i * bs, (i + 1) * bs), pin=new[:full] if full else None)
    if unpin_old:
        cache.unpin(ids)
    out = {"object": "prefix_cache.edit", "way": way, "tokens": len(new), "token_ids": new,
           "field": {"old": edit.old_value, "new": edit.new_value, "start_token": edit.start, "end_token": edit.end},
           "recomputed_tokens": result.recomputed, "appended_tokens": result.appended,
           "partial_tokens": result.partial, "partial_layers": result.partial_layers,
           "reused_tokens": len(ids) - result.recomputed if result.way != "full" else 0,
           "computed_tail_tokens": len(ids) - cached, "pinned_tokens": full, "edit_ms": round(result.ms, 2),
           "cache": cache.stats()}
    if note is not None:
        out["erratum"] = note
    return out
