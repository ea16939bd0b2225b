"""The API's own description: /openapi.json, /docs and /redoc behind the API key, and a schema that says
what the server really answers: 400 with kvtool's error object where FastAPI would document 422 (the
server turns every validation error into a 400), plus 401, 404, 413, 429 and 503 in the same shape."""

from __future__ import annotations

from fastapi import Depends, FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from pydantic import BaseModel


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error the server answers: {"error": {message, type, param, code}} (OpenAI's shape)."""

    error: ErrorDetail


ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}
# status -> when; 400 on every route with input, the rest where they apply
STATUSES = {400: "invalid request: the message says which field and why",
            401: "missing or wrong API key (kvtool serve --api-key)",
            404: "the request names a model this server does not serve",
            413: "request body over --max-body-bytes",
            429: "server busy: more requests in flight than --max-active + --max-queue",
            503: "the server is shutting down, or its worker stopped"}
# the generating routes and how each stream ends (llama.cpp's /completion: an event with "stop": true)
GENERATING = {path: "data: {...}\n\ndata: [DONE]\n\n"
              for path in ("/v1/chat/completions", "/v1/chat/completions/raw", "/v1/completions")}
GENERATING["/completion"] = 'data: {"content": "...", "stop": false}\n\ndata: {"content": "", "stop": true, ...}\n\n'
GENERATING["/v1/responses"] = ("event: response.created\ndata: {...}\n\n...event: response.completed\n"
                               "data: {...}\n\n")
# one event of such a stream: its data is a JSON chunk (or the OpenAI routes' closing [DONE])
SSE_EVENT = {"type": "object", "required": ["data"], "properties": {
    "data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"}}}


def schema(app: FastAPI, keyed: bool, open_paths: set[str]) -> dict:
    """The OpenAPI document of ``app`` with kvtool's error responses (see the module docstring)."""
    doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    components = doc.setdefault("components", {}).setdefault("schemas", {})
    components["ErrorResponse"] = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
    components.update(components["ErrorResponse"].pop("$defs", {}))
    for path, ops in doc.get("paths", {}).items():
        for method, op in ops.items():
            responses = op.setdefault("responses", {})
            had_input = responses.pop("422", None) is not None or "requestBody" in op or bool(op.get("parameters"))
            wanted = [400, 404] if had_input else []
            if method == "post":
                wanted.append(413)
            if keyed and path not in open_paths:
                wanted.append(401)
            if path in GENERATING:
                wanted += [429, 503]
                ok = responses.get("200", {}).setdefault("content", {})
                ok["text/event-stream"] = {"schema": SSE_EVENT, "example": GENERATING[path]}  # "stream": true
            for status in wanted:
                responses[str(status)] = {"description": STATUSES[status],
                                          "content": {"application/json": {"schema": ERROR_REF}}}
    for unused in ("HTTPValidationError", "ValidationError"):
        components.pop(unused, None)
    return doc


def install_docs(app: FastAPI, check_key, keyed: bool, open_paths: set[str]) -> None:
    """/openapi.json, /docs and /redoc, each needing the API key when the server has one (create the app with
    openapi_url, docs_url and redoc_url set to None)."""
    cached: list[dict] = []

    def document() -> dict:
        if not cached:
            cached.append(schema(app, keyed, open_paths))
        return cached[0]

    app.openapi = document
    guard = [Depends(check_key)]

    @app.get("/openapi.json", include_in_schema=False, dependencies=guard)
    async def openapi_json():
        return JSONResponse(document())

    @app.get("/docs", include_in_schema=False, dependencies=guard)
    async def swagger():
        return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{app.title} - docs")

    @app.get("/redoc", include_in_schema=False, dependencies=guard)
    async def redoc():
        return get_redoc_html(openapi_url="/openapi.json", title=f"{app.title} - ReDoc")
