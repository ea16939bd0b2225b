"""VllmBackend: kvtool serve's routes over vLLM's in-process engine (see kvtool.serving.backend).

`load_backend(model, dtype, engine_args, cfg)` resolves the model as kvtool does (hub id, HF folder, or a
GGUF file converted once to an fp32 HF folder in kvtool's cache), reads only its tokenizer and config
for kvtool's side, and lets vLLM load the weights. With --skills, --kv-store or --cache-file it mounts kvtool's
KV connector (kvtool.integrations.vllm.connector) exactly as a plain `vllm serve` does, through kv_transfer_config
(kvtool.integrations.vllm.mount): the skills are compiled with kvtool's model first, which is then released, and the
prefix store is the shared block store (--cache-file imports a .kvc into it at start and exports it on save).
Routes that need kvtool's own engine (the prefix tree, pins, cache edits, the attention inspector) answer 501
naming the engine.
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
KVTOOL_ONLY = [
    ("GET", "/v1/cache/tree", "kvtool's prefix tree (vLLM's prefix-cache counters are under /metrics)"),
    ("POST", "/v1/cache/pin", "pinned prefixes (kvtool's own prefix cache)"),
    ("POST", "/v1/cache/unpin", "pinned prefixes (kvtool's own prefix cache)"),
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

    def __init__(self, engine, model, cfg: ServerConfig, mounted=None):
        """mounted: what kvtool's connector serves (Mounted; None: no connector)."""
        self.engine, self.model, self.cfg, self.mounted = engine, model, cfg, mounted
        self.worker = None
        self._saver = None

    @property
    def store(self):
        return self.mounted.store if self.mounted is not None else None

    def start_worker(self, metrics):
        from kvtool.integrations.vllm.worker import VllmCore
        from kvtool.serving.worker import Worker

        catalog = self.mounted.catalog if self.mounted is not None else None
        self.worker = Worker(VllmCore(self.engine, self.model, self.cfg.max_active, catalog), self.cfg.max_queue,
                             metrics)
        return self.worker

    def metrics_lines(self) -> list[str]:
        """vLLM's own Prometheus metrics (vllm:*, the connector's vllm:kvtool_* among them), as its engine
        registers them in this process."""
        from prometheus_client import REGISTRY, generate_latest

        out = []
        for line in generate_latest(REGISTRY).decode().splitlines():
            name = line.split()[2] if line.startswith("# ") and len(line.split()) > 2 else line
            if name.startswith("vllm:"):
                out.append(line)
        return out

    async def on_start(self) -> None:
        if self.cfg.cache_save_every and self.mounted is not None and self.mounted.cache_file:
            self._saver = asyncio.create_task(self._autosave(self.cfg.cache_save_every))

    async def _autosave(self, every: float) -> None:
        while True:
            await asyncio.sleep(every)
            await run_in_threadpool(self.mounted.export, "autosaved")

    async def on_stop(self) -> None:
        if self._saver:  # a save in progress finishes first, so the shutdown save is the last one
            self._saver.cancel()
            await asyncio.gather(self._saver, return_exceptions=True)
        self.worker.stop()
        shutdown = getattr(self.engine.engine_core, "shutdown", None)
        if shutdown is not None:
            shutdown()  # the connector's writer publishes what it queued
        if self.mounted is not None:
            self.mounted.export("saved")
            self.mounted.close()

    def routers(self, worker, served) -> list[APIRouter]:
        from kvtool.serving.backend import skills_listing

        mounted = self.mounted
        served.skills = mounted.catalog if mounted is not None else None
        router = APIRouter()
        for method, path, what in KVTOOL_ONLY:
            router.add_api_route(path, refuser(what), methods=[method], include_in_schema=False)

        @router.get("/v1/skills")
        async def list_skills():
            """The skills the connector supplies (kvtool serve --engine vllm --skills DIR)."""
            from kvtool.skills.repair import make_repair

            return skills_listing(served.skills, make_repair("none"))

        @router.get("/v1/cache")
        async def cache_info():
            """The connector's block store (kvtool cache info reads the same), or none."""
            if mounted is None or mounted.store is None:
                raise refusal("a block store without --kv-store or --cache-file", "give it --kv-store LOCATION")
            from kvtool.cache.shared import describe_store

            return {"object": "kv_store", "engine": "vllm", **await run_in_threadpool(describe_store, mounted.store)}

        @router.post("/v1/cache/save")
        async def save():
            """Export the store's chains of this model to --cache-file (a .kvc any kvtool engine loads)."""
            if mounted is None or not mounted.cache_file:
                raise refusal("a cache file without --cache-file PATH", "give it --cache-file PATH")
            saved = await run_in_threadpool(mounted.export, "saved", True)
            return {"object": "prefix_cache.save", "path": mounted.cache_file, **saved}

        @router.post("/v1/cache/reset")
        async def reset():
            """Empty vLLM's prefix cache (as kvtool's route empties kvtool's), e.g. between benchmark scenarios; a
            private store (--cache-file alone) is emptied with it, a shared one (--kv-store) is kept."""
            done = await run_in_threadpool(worker.run_exclusive, self.engine.reset_prefix_cache, 60.0)
            if not done:
                raise Unavailable("vLLM did not reset its prefix cache (requests still hold cached blocks); retry "
                                  "when they finish", code="cache_busy")
            out = {"object": "prefix_cache.reset", "engine": "vllm"}
            if mounted is not None and mounted.store is not None:
                out["store"] = await run_in_threadpool(mounted.reset)
            return out

        return [router]


def load_backend(model: str, dtype: str = "auto", engine_args: dict | None = None,
                 cfg: ServerConfig | None = None, kv=None):
    """(TextModel, VllmBackend) for `model`: kvtool's text side and vLLM's engine, warmed up by one token (the
    first forward pays vLLM's one-time kernel set-up, so the first request does not). A model vLLM cannot
    load raises ModelLoadError with vLLM's reason in one line. kv: an EngineConfig whose skills_dir, kv_store or
    cache_file mount kvtool's KV connector (kvtool.integrations.vllm.attach)."""
    from kvtool.integrations.vllm.settings import apply_env_defaults, engine_kwargs
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
    mounted = None
    if kv is not None:
        from kvtool.integrations.vllm.attach import mount

        mounted = mount(model, text, kv, kwargs["dtype"] if kwargs["dtype"] != "auto" else "float32")
    if mounted is not None:
        from vllm.config import KVTransferConfig

        from kvtool.integrations.vllm.mount import transfer_config

        kwargs["kv_transfer_config"] = KVTransferConfig(**transfer_config(mounted.extra))
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
    return text, VllmBackend(engine, text, cfg or ServerConfig(), mounted)


def warm_up(engine) -> None:
    from vllm import SamplingParams

    engine.add_request("kvtool-warmup", {"prompt_token_ids": [0, 1]}, SamplingParams(max_tokens=1, temperature=0))
    while engine.has_unfinished_requests():
        engine.step()


def one_line(exc: BaseException) -> str:
    """The last non-empty line of an exception's message (vLLM's reasons come after its own context)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[-1] if lines else ''}".rstrip(": ")
