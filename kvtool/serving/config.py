"""ServerConfig: the one place where `kvtool serve` defaults live (the CLI reads them here)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # when set, every /v1 and token route needs "Authorization: Bearer KEY"
    served_model_name: str | None = None  # default: the loaded model's name
    max_active: int = 16  # requests batched together in each decode step (continuous batching)
    max_queue: int = 64  # requests waiting beyond max_active; one more gets 429
    prefill_budget: int = 512  # prompt tokens per batched step: bounds how long one step stalls running streams
    kv_bytes: int | None = None  # KV of the running requests; beyond it the newest is preempted (and recomputed
    # later). None: a quarter of the memory available at start, at most 16 GiB (kvtool.cache.manager.default_budget)
    default_max_tokens: int | None = None  # when a request names none; None = up to the context window
    max_body_bytes: int = 16 << 20  # a larger request body gets 413 unread; far more than a context window holds
    tool_parser: str = "qwen"  # key in kvtool.serving.toolparse.TOOL_FORMATS
    extra_metrics: Callable[[], Iterable[str]] | None = None  # more Prometheus lines (e.g. prefix cache)
