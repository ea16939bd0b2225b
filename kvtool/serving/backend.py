"""What computes behind kvtool serve's routes. KvtoolBackend: kvtool's own engine, with its prefix cache,
skill blocks, cache routes and the attention inspector. (kvtool.integrations.vllm.backend: the vLLM one.)

A backend gives create_app: `name`, `start_worker(metrics)` (kvtool.serving.worker.Worker over
the backend's engine core), `metrics_lines` (more Prometheus lines, or
None), `routers(worker, served)` (its own routes) and the `on_start` / `on_stop` coroutines of the
server's lifespan.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool

from kvtool.config import EngineConfig, SamplingParams
from kvtool.engine import Engine
from kvtool.errors import InvalidParameterError
from kvtool.serving.config import ServerConfig
from kvtool.serving.core import KvtoolCore
from kvtool.serving.served import ServedModel
from kvtool.serving.worker import Worker

log = logging.getLogger("kvtool.serving")


def mount_skills(engine: Engine, served: ServedModel, prefix_cache, catalog=None):
    """Install a SkillSplicer around the prefix cache when EngineConfig.skills_dir (or a catalog) is given."""
    folder = engine.config.skills_dir
    if catalog is None and not folder:
        return None
    from kvtool.skills.catalog import load_catalog
    from kvtool.skills.splice import SkillSplicer

    if catalog is None:
        catalog = load_catalog(folder, engine.model, preamble=engine.config.skill_preamble)
    splicer = SkillSplicer(catalog, engine.config.skill_repair, inner=prefix_cache, chunk=engine.config.prefill_chunk,
                           min_tokens=engine.config.skill_min_tokens)
    engine.prefix_cache, served.skills = splicer, catalog
    log.info("serving %d skills (%s), repair %s", len(catalog), ", ".join(catalog.names()), engine.config.skill_repair)
    return splicer


def skills_listing(catalog, repair) -> dict:
    """GET /v1/skills on either engine: the catalog served (None: no --skills) and the repair applied."""
    if catalog is None:
        return {"object": "list", "data": [], "enabled": False}
    from kvtool.skills.repair import describe

    return {"object": "list", "enabled": True, "render": catalog.render, "repair": describe(repair),
            "data": [{"object": "skill", **row} for row in catalog.summary()]}


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
    log.info("%s the prefix cache to %s: %d tokens, %d pins, %d bytes written", what, path, info["tokens"],
             info["pins"], info.get("written_bytes", info.get("bytes", 0)))
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


class KvtoolBackend:
    name = "kvtool"

    def __init__(self, model, served: ServedModel, engine_config: EngineConfig | None, prefix_cache, skills,
                 cfg: ServerConfig):
        self.model, self.served, self.cfg = model, served, cfg
        # the server's --max-active and --kv-bytes are the engine's scheduler settings
        engine_config = engine_config or EngineConfig()
        engine_config = replace(engine_config, max_running=cfg.max_active,
                                kv_bytes=engine_config.kv_bytes if cfg.kv_bytes is None else cfg.kv_bytes)
        self.engine = engine = Engine(model, engine_config, prefix_cache)
        if prefix_cache is None:  # one prefix cache for every request, unless EngineConfig turns it off
            from kvtool.cache.manager import attach_prefix_cache

            prefix_cache = attach_prefix_cache(engine)
        self.prefix_cache = prefix_cache
        self.splicer = mount_skills(engine, served, prefix_cache, skills)
        if cfg.cache_save_every is not None and (prefix_cache is None or engine.config.cache_file is None):
            raise InvalidParameterError("--cache-save-every saves the prefix cache to --cache-file; give a cache "
                                        "file (EngineConfig.cache_file) with the prefix cache on")
        self.metrics_lines = prefix_cache.prometheus_lines if prefix_cache is not None else None
        self.worker: Worker | None = None
        self._saver = None

    def start_worker(self, metrics) -> Worker:
        cfg = self.cfg
        self.worker = Worker(KvtoolCore(self.engine), cfg.max_queue, metrics)
        return self.worker

    async def on_start(self) -> None:
        if self.cfg.cache_save_every:
            self._saver = asyncio.create_task(autosave(self.prefix_cache, self.engine.config.cache_file, self.model,
                                                       self.cfg.cache_save_every))

    async def on_stop(self) -> None:
        if self._saver:  # a save in progress finishes first (its thread can't be stopped), so the last save wins
            self._saver.cancel()
            await asyncio.gather(self._saver, return_exceptions=True)
        self.worker.stop()
        save_cache_file(self.prefix_cache, self.engine.config.cache_file, self.model)

    def routers(self, worker: Worker, served: ServedModel) -> list[APIRouter]:
        from kvtool.serving.cache_edit_http import edit_router
        from kvtool.serving.cache_http import cache_router
        from kvtool.serving.inspect_http import inspect_router

        model, engine, prefix_cache, splicer = self.model, self.engine, self.prefix_cache, self.splicer
        skills = APIRouter()

        @skills.get("/v1/skills")
        async def list_skills():
            """The skills this server splices (kvtool serve --skills DIR); request them with the `skills` field."""
            return skills_listing(served.skills if splicer is not None else None, splicer and splicer.repair)

        async def prefill_in_batch(ids: list[int]) -> None:  # a pin's KV, chunked beside the running streams
            async for _ in worker.submit(ids, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)):
                pass

        return [skills,
                cache_router(lambda: prefix_cache, lambda: model, served.check_name, engine.config.cache_file,
                             prefill_in_batch),
                edit_router(lambda: prefix_cache, lambda: model, served.check_name, worker.run_exclusive),
                inspect_router(lambda: model, worker, chat_stream=True)]
