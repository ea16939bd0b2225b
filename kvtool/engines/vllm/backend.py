"""VllmBackend: kvtool serve's routes over vLLM's in-process engine (see kvtool.serving.backend).

`load_backend(model, dtype, engine_args, cfg)` resolves the model as kvtool does (hub id, HF folder, or a
GGUF file converted once to an fp32 HF folder in kvtool's cache), reads only its tokenizer and config
for kvtool's side, and lets vLLM load the weights. Routes that need kvtool's own KV cache (the prefix
tree, pins, cache files, skill blocks, the attention inspector) answer 501 naming the engine.
"""

from __future__ import annotations

import logging
import time

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool

from kvtool.errors import ModelLoadError
from kvtool.serving.config import ServerConfig
from kvtool.serving.errors import NotSupported, Unavailable

log = logging.getLogger("kvtool.serving")

# (method, path, what the route needs that vLLM does not expose)
KVTOOL_ONLY = [
    ("GET", "/v1/skills", "skill KV blocks spliced into prompts"),
    ("GET", "/v1/cache", "kvtool's prefix cache statistics (vLLM's prefix-cache counters are under /metrics)"),
    ("GET", "/v1/cache/tree", "the prefix tree of kvtool's cache"),
    ("POST", "/v1/cache/save", "saving kvtool's prefix cache to a file"),
    ("POST", "/v1/cache/pin", "pinning a prefix in kvtool's cache"),
    ("POST", "/v1/cache/unpin", "pinning a prefix in kvtool's cache"),
    ("POST", "/v1/cache/edit", "editing a pinned prefix in kvtool's cache"),
    ("GET", "/inspect", "the attention inspector (attention weights from kvtool's model runner)"),
    ("GET", "/inspect/static/{name}", "the attention inspector"),
    ("GET", "/v1/viz/config", "the attention inspector"),
    ("POST", "/v1/viz/render", "the attention inspector"),
    ("POST", "/v1/viz/tokens", "the attention inspector"),
    ("POST", "/v1/viz/attention", "attention weights from kvtool's model runner"),
    ("POST", "/v1/viz/generate", "the attention inspector"),
]


def refusal(what: str) -> NotSupported:
    return NotSupported(f"this server runs --engine vllm, which does not give {what}; start kvtool serve with "
                        "--engine kvtool (the default) for this route", code="unsupported_by_engine")


def refuser(what: str):
    async def refuse():
        raise refusal(what)

    return refuse


class VllmBackend:
    name = "vllm"

    def __init__(self, engine, model, cfg: ServerConfig):
        self.engine, self.model, self.cfg = engine, model, cfg
        self.worker = None

    def start_worker(self, metrics):
        from kvtool.engines.vllm.worker import VllmWorker

        self.worker = VllmWorker(self.engine, self.model, self.cfg.max_active, self.cfg.max_queue, metrics)
        return self.worker

    def metrics_lines(self) -> list[str]:
        """vLLM's own Prometheus metrics (vllm:*), as its engine registers them in this process."""
        from prometheus_client import REGISTRY, generate_latest

        out = []
        for line in generate_latest(REGISTRY).decode().splitlines():
            name = line.split()[2] if line.startswith("# ") and len(line.split()) > 2 else line
            if name.startswith("vllm:"):
                out.append(line)
        return out

    async def on_start(self) -> None:
        pass

    async def on_stop(self) -> None:
        self.worker.stop()
        shutdown = getattr(self.engine.engine_core, "shutdown", None)
        if shutdown is not None:
            shutdown()

    def routers(self, worker, served) -> list[APIRouter]:
        router = APIRouter()
        for method, path, what in KVTOOL_ONLY:
            router.add_api_route(path, refuser(what), methods=[method], include_in_schema=False)

        @router.post("/v1/cache/reset")
        async def reset():
            """Empty vLLM's prefix cache (as kvtool's route empties kvtool's), e.g. between benchmark scenarios."""
            done = await run_in_threadpool(worker.run_exclusive, lambda engine: engine.reset_prefix_cache())
            if not done:
                raise Unavailable("vLLM did not reset its prefix cache (requests still hold cached blocks); retry "
                                  "when they finish", code="cache_busy")
            return {"object": "prefix_cache.reset", "engine": "vllm"}

        return [router]


def load_backend(model: str, dtype: str = "auto", engine_args: dict | None = None,
                 cfg: ServerConfig | None = None):
    """(TextModel, VllmBackend) for `model`: kvtool's text side and vLLM's engine, warmed up by one token (the
    first forward pays vLLM's one-time kernel set-up, so the first request does not). A model vLLM cannot
    load raises ModelLoadError with vLLM's reason in one line."""
    from kvtool.engines.vllm.settings import apply_env_defaults, engine_kwargs
    from kvtool.models.loading import load_text

    apply_env_defaults()
    text = load_text(model)
    import torch
    from vllm import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    kwargs = engine_kwargs(str(text.folder), dtype, torch.cuda.is_available(), engine_args or {})
    t0 = time.perf_counter()
    try:
        engine = LLMEngine.from_engine_args(EngineArgs(**kwargs))
    except Exception as exc:
        raise ModelLoadError(f"vLLM could not load {text.name}: {one_line(exc)}") from None
    text.context_window = engine.model_config.max_model_len
    text.precision = str(engine.model_config.dtype).replace("torch.", "")
    text.info = {"device": "vllm " + ("cuda" if torch.cuda.is_available() else "cpu"), "dtype": text.precision,
                 "weights": "dense"}
    warm_up(engine)
    log.info("vLLM engine ready in %.1f s (%s, max_model_len %d)", time.perf_counter() - t0, text.precision,
             text.context_window)
    return text, VllmBackend(engine, text, cfg or ServerConfig())


def warm_up(engine) -> None:
    from vllm import SamplingParams

    engine.add_request("kvtool-warmup", {"prompt_token_ids": [0, 1]}, SamplingParams(max_tokens=1, temperature=0))
    while engine.has_unfinished_requests():
        engine.step()


def one_line(exc: BaseException) -> str:
    """The last non-empty line of an exception's message (vLLM's reasons come after its own context)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[-1] if lines else ''}".rstrip(": ")
