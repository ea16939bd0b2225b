"""ServerConfig: the one place where `kvtool serve` defaults live (the CLI reads them here)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # when set, every route but /health (and /metrics with metrics_open) needs
    # "Authorization: Bearer KEY", the API documentation (/openapi.json, /docs, /redoc) included
    served_model_name: str | None = None  # default: the loaded model's name
    max_active: int = 16  # requests batched together in each decode step (continuous batching)
    max_queue: int = 64  # requests waiting beyond max_active; one more gets 429
    kv_bytes: int | None = None  # KV of the running requests; beyond it the newest is preempted (and recomputed
    # later). None: half the engine's KV memory budget, the prefix cache taking the other (Engine.memory)
    default_max_tokens: int | None = None  # when a request names none; None = up to the context window
    max_body_bytes: int = 16 << 20  # a larger request body gets 413 unread; far more than a context window holds
    cache_save_every: float | None = None  # seconds: save the prefix cache to EngineConfig.cache_file this often
    # when it changed since the last save (a crash then loses at most this much); None: at shutdown and on request
    shutdown_timeout: float = 10.0  # seconds running requests get to finish after SIGTERM/SIGINT; then they end
    # with finish_reason "abort" and the server saves its cache file and exits (kvtool.serving.shutdown)
    metrics_open: bool = False  # with api_key: /metrics answers without the key too (/health always does)
    responses_store: int = 256  # responses kept for previous_response_id and GET /v1/responses/{id}; the oldest
    # is dropped past it (0: none kept)
    tool_parser: str = "qwen"  # key in kvtool.serving.toolparse.TOOL_FORMATS
    extra_metrics: Callable[[], Iterable[str]] | None = None  # more Prometheus lines (e.g. prefix cache)

    def validate(self) -> "ServerConfig":
        """InvalidParameterError naming the first bad value (by its `kvtool serve` flag); return self."""
        from kvtool.config import is_whole
        from kvtool.errors import InvalidParameterError
        from kvtool.serving.toolparse import TOOL_FORMATS

        if not is_whole(self.port) or self.port > 65535:
            raise InvalidParameterError(f"--port must be in 0..65535, got {self.port}")
        for name, least, optional in (("max_active", 1, False), ("max_queue", 0, False),
                                      ("kv_bytes", 1, True), ("max_body_bytes", 1, False),
                                      ("default_max_tokens", 1, True), ("responses_store", 0, False)):
            value = getattr(self, name)
            if not (optional and value is None) and not is_whole(value, least):
                raise InvalidParameterError(f"--{name.replace('_', '-')} must be >= {least}, got {value!r}")
        every = self.cache_save_every
        if every is not None and (isinstance(every, bool) or not isinstance(every, (int, float)) or not every >= 1):
            raise InvalidParameterError(f"--cache-save-every must be a number of seconds >= 1, got {every!r}")
        wait = self.shutdown_timeout
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait < float("inf"):
            raise InvalidParameterError(f"--shutdown-timeout must be a number of seconds >= 0, got {wait!r}")
        if self.tool_parser not in TOOL_FORMATS:
            raise InvalidParameterError(f"--tool-parser {self.tool_parser!r} is not one of {', '.join(TOOL_FORMATS)}")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise InvalidParameterError("--api-key must be a non-empty string")
        return self
