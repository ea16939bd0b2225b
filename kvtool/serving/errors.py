"""Serving errors and their OpenAI-shaped JSON: {"error": {message, type, param, code}}.

Every KvtoolError maps to its status_code (400 by default); the server adds the few
statuses that only HTTP has (401, 404, 429, 503).
"""

from __future__ import annotations

import re

from kvtool.errors import KvtoolError

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
               429: "rate_limit_error", 500: "server_error", 501: "not_supported_error", 503: "server_error"}


class ServingError(KvtoolError):
    """A client-facing error with an OpenAI `param` and `code`."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


class AuthError(ServingError):
    status_code = 401


class ModelNotFound(ServingError):
    status_code = 404


class QueueFull(ServingError):
    status_code = 429


class Unavailable(ServingError):
    status_code = 503


class ServerFault(ServingError):
    status_code = 500


class NotSupported(ServingError):
    """A route the serving engine cannot answer (e.g. the prefix tree on --engine vllm): 501, naming the engine."""

    status_code = 501


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    etype = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": valid_text(message), "type": etype, "param": param and valid_text(param),
                      "code": code}}


def valid_text(text: str) -> str:
    """A lone surrogate echoed from the request (a bad key in a field path) spelled out as \\udXXX: the body
    stays valid UTF-8 JSON."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_from_exception(exc: KvtoolError) -> tuple[int, dict]:
    status = getattr(exc, "status_code", 400)
    param = getattr(exc, "param", None)
    code = getattr(exc, "code", None)
    if param is None:  # InvalidParameterError says "invalid sampling parameter NAME=..."
        m = re.match(r"invalid sampling parameter (\w+)=", str(exc))
        param = m.group(1) if m else None
    if code is None:
        code = {"ContextWindowError": "context_length_exceeded"}.get(type(exc).__name__)
    return status, error_body(status, str(exc), param, code)
