"""VllmBackend: kvtool serve's routes over vLLM's in-process engine (see kvtool.serving.backend).

`load_backend(model, dtype, engine_args, cfg)` resolves the model as kvtool does (hub id, HF folder, or a
GGUF file converted once to an fp32 HF folder in kvtool's cache), reads only its tokenizer and config
for kvtool's side, and lets vLLM load the weights. With --skills or --cache-file it also loads kvtool's own
model and installs kvtool's KV connector (kvtool.engines.vllm.connector): skill blocks and the prefix store
are then served through vLLM's KV-connector API, with the same routes as on kvtool's engine. Routes that still
need kvtool's own engine (cache edits, the attention inspector) answer 501 naming the engine.
"""

from __future__ import annotations

import asyncio
import logging
import time

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool

from kvtool.config import EngineConfig
from kvtool.errors import ModelLoadError
from kvtool.serving.config import ServerConfig
from kvtool.serving.errors import NotSupported, Unavailable

log = logging.getLogger("kvtool.serving")

# (method, path, what the route needs that vLLM does not expose)
# Served by the kvtool store when --cache-file gives one (kvtool.engines.vllm.side), refused without it.
STORE_ROUTES = [
    ("GET", "/v1/cache", "kvtool's prefix store without --cache-file (vLLM's prefix-cache counters are under /metrics)"),
    ("GET", "/v1/cache/tree", "kvtool's prefix store without --cache-file"),
    ("POST", "/v1/cache/save", "a cache file without --cache-file PATH"),
    ("POST", "/v1/cache/pin", "kvtool's prefix store without --cache-file"),
    ("POST", "/v1/cache/unpin", "kvtool's prefix store without --cache-file"),
]
KVTOOL_ONLY = [
    ("POST", "/v1/cache/edit", "editing a pinned prefix in place (kvtool's own KV cache)"),
    ("GET", "/inspect", "the attention inspector (attention weights from kvtool's model runner)"),
    ("GET", "/inspect/static/{name}", "the attention inspector"),
    ("GET", "/v1/viz/config", "the attention inspector"),
    ("POST", "/v1/viz/render", "the attention inspector"),
    ("POST", "/v1/viz/tokens", "the attention inspector"),
    ("POST", "/v1/viz/attention", "attention weights from kvtool's model runner"),
    ("POST", "/v1/viz/generate", "the attention inspector"),
]


def refusal(what: str, remedy: str = "start kvtool serve with --engine kvtool (the default)") -> NotSupported:
    return NotSupported(f"this server runs --engine vllm, which does not give {what}; {remedy} for this route",
                        code="unsupported_by_engine")


def refuser(what: str, remedy: str | None = None):
    async def refuse():
        raise refusal(what, remedy) if remedy else refusal(what)

    return refuse


class VllmBackend:
    name = "vllm"

    def __init__(self, engine, model, cfg: ServerConfig, side=None, cache_file: str | None = None):
        """side: the KvtoolSide the connector serves from (None: no connector); cache_file: the store's file."""
        self.engine, self.model, self.cfg, self.side, self.cache_file = engine, model, cfg, side, cache_file
        self.worker = None
        self._saver = None

    @property
    def store(self):
        return self.side.store if self.side is not None else None

    def start_worker(self, metrics):
        from kvtool.engines.vllm.worker import VllmCore
        from kvtool.serving.worker import Worker

        self.worker = Worker(VllmCore(self.engine, self.model, self.cfg.max_active, self.side), self.cfg.max_queue,
                             metrics)
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
        if self.cfg.cache_save_every and self.store is not None:
            from kvtool.serving.backend import autosave

            self._saver = asyncio.create_task(autosave(self.store, self.cache_file, self.side.model,
                                                       self.cfg.cache_save_every))

    async def on_stop(self) -> None:
        if self._saver:  # a save in progress finishes first, so the shutdown save is the last one
            self._saver.cancel()
            await asyncio.gather(self._saver, return_exceptions=True)
        self.worker.stop()
        if self.store is not None:
            from kvtool.serving.backend import save_cache_file

            save_cache_file(self.store, self.cache_file, self.side.model)
        shutdown = getattr(self.engine.engine_core, "shutdown", None)
        if shutdown is not None:
            shutdown()

    def routers(self, worker, served) -> list[APIRouter]:
        from kvtool.serving.backend import skills_listing

        side, store = self.side, self.store
        served.skills = side.catalog if side is not None else None
        router = APIRouter()
        for method, path, what in KVTOOL_ONLY:
            router.add_api_route(path, refuser(what), methods=[method], include_in_schema=False)
        for method, path, what in STORE_ROUTES if store is None else []:
            router.add_api_route(path, refuser(what, "give it --cache-file PATH (kvtool's KV connector keeps the "
                                                   "store)"), methods=[method], include_in_schema=False)

        @router.get("/v1/skills")
        async def list_skills():
            """The skills the connector supplies (kvtool serve --engine vllm --skills DIR)."""
            return skills_listing(served.skills, side and side.repair)

        @router.post("/v1/cache/reset")
        async def reset():
            """Empty vLLM's prefix cache (as kvtool's route empties kvtool's), e.g. between benchmark scenarios,
            and the kvtool store behind it."""
            done = await run_in_threadpool(worker.run_exclusive, self.engine.reset_prefix_cache, 60.0)
            if not done:
                raise Unavailable("vLLM did not reset its prefix cache (requests still hold cached blocks); retry "
                                  "when they finish", code="cache_busy")
            out = {"object": "prefix_cache.reset", "engine": "vllm"}
            if store is not None:
                out["store"] = store.reset()
            return out

        if store is None:
            return [router]
        from kvtool.serving.cache_http import cache_router

        async def prefill_in_batch(ids: list[int]) -> None:  # the connector copies the prompt into the store
            from kvtool.config import SamplingParams

            async for _ in worker.submit(ids, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)):
                pass

        return [router, cache_router(lambda: store, lambda: side.model, served.check_name, self.cache_file,
                                     prefill_in_batch)]


def load_side(model: str, dtype: str, kv):
    """The KvtoolSide for --skills / --cache-file (kv: an EngineConfig): kvtool's own model on the CPU, the skill
    catalog compiled for it, and the prefix store loaded from the cache file when it exists (a file made for
    another setup raises CacheFormatError naming each difference)."""
    import os

    from kvtool.cache.manager import PrefixCache
    from kvtool.engines.vllm.side import KvtoolSide
    from kvtool.models.loading import load

    kmodel = load(model, device="cpu", dtype=dtype, progress=False, packed=False)  # dense weights only: one copy
    catalog = None
    if kv.skills_dir:
        from kvtool.skills.catalog import load_catalog

        catalog = load_catalog(kv.skills_dir, kmodel, preamble=kv.skill_preamble)
    store = None
    if kv.cache_file:
        store = PrefixCache.for_runner(kmodel.runner, kv.cache_bytes, kv.prefix_block)
        if os.path.exists(kv.cache_file):
            store.load(kv.cache_file, kmodel)
    return KvtoolSide(kmodel, catalog, kv.skill_repair, store, kv.skill_min_tokens, kv.prefill_chunk)


def load_backend(model: str, dtype: str = "auto", engine_args: dict | None = None,
                 cfg: ServerConfig | None = None, kv=None):
    """(TextModel, VllmBackend) for `model`: kvtool's text side and vLLM's engine, warmed up by one token (the
    first forward pays vLLM's one-time kernel set-up, so the first request does not). A model vLLM cannot
    load raises ModelLoadError with vLLM's reason in one line. kv: an EngineConfig whose skills_dir or
    cache_file installs kvtool's KV connector (load_side)."""
    from kvtool.engines.vllm.settings import apply_env_defaults, engine_kwargs
    from kvtool.models.loading import load_text

    apply_env_defaults()
    text = load_text(model, (kv or EngineConfig()).generation_config)  # its sampling defaults too
    import torch
    from vllm import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    named = getattr(text.hf_config, "architectures", None)
    kwargs = engine_kwargs(str(text.folder), dtype, torch.cuda.is_available(), engine_args or {},
                           None if named else text.hf_config.model_type)
    if isinstance(kwargs.get("structured_outputs_config"), dict):  # EngineArgs keeps a dict as it is
        from vllm.config import StructuredOutputsConfig

        kwargs["structured_outputs_config"] = StructuredOutputsConfig(**kwargs["structured_outputs_config"])
    side = None
    if kv is not None and (kv.skills_dir or kv.cache_file):
        from vllm.config import KVTransferConfig

        from kvtool.engines.vllm.connector import SIDES, transfer_config

        side = load_side(model, "float32" if kwargs["dtype"] == "float32" else kwargs["dtype"], kv)
        key = f"side-{id(side)}"
        SIDES[key] = side
        kwargs["kv_transfer_config"] = KVTransferConfig(**transfer_config(key))
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
    return text, VllmBackend(engine, text, cfg or ServerConfig(), side, kv.cache_file if side is not None else None)


def warm_up(engine) -> None:
    from vllm import SamplingParams

    engine.add_request("kvtool-warmup", {"prompt_token_ids": [0, 1]}, SamplingParams(max_tokens=1, temperature=0))
    while engine.has_unfinished_requests():
        engine.step()


def one_line(exc: BaseException) -> str:
    """The last non-empty line of an exception's message (vLLM's reasons come after its own context)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[-1] if lines else ''}".rstrip(": ")
