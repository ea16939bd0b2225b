"""What `kvtool serve --engine vllm` mounts through kvtool's KV connector: the same kv_connector_extra_config a plain
`vllm serve` is given (kvtool.integrations.vllm.mount), built from kvtool's options.

- --skills DIR: the skills are compiled with kvtool's own model (or read from the skill cache), which is then
  released before vLLM loads, so the server holds one copy of the weights; the connector reads the .kvb files.
- --kv-store LOCATION: the shared block store (other servers and kvtool's own engine on it share prefixes).
- --cache-file PATH: a .kvc imported into the store at start and exported from it by POST /v1/cache/save, by
  --cache-save-every and at shutdown; without --kv-store the store is a private folder, removed at exit.
The store's records are kvtool's prefix blocks (--prefix-block tokens, the model's dtype), so a file or store
written by kvtool's engine serves vLLM and back.
"""

from __future__ import annotations

import gc
import logging
import shutil
import tempfile
from dataclasses import dataclass

from kvtool.config import EngineConfig

log = logging.getLogger("kvtool.serving")


@dataclass
class Mounted:
    extra: dict  # kv_connector_extra_config
    catalog: object = None  # the SkillCatalog served (its blocks' KV released: the connector reads the files)
    store: object = None  # the KVStore the connector shares, opened here for /v1/cache and the .kvc file
    cache_file: str | None = None
    model_name: str = ""
    private: str | None = None  # the store's folder when it is this server's own

    def export(self, what: str = "saved", raise_errors: bool = False) -> dict:
        """Write the store's chains of this model to the cache file; a failure is logged (or raised)."""
        if not self.cache_file or self.store is None:
            return {}
        from kvtool.cache.storefile import export_store

        try:
            settle(self.store)
            saved = export_store(self.store, self.cache_file, self.model_name)
            log.info("kvtool: %s the block store to %s", what, self.cache_file)
            return saved
        except Exception as exc:
            if raise_errors:
                raise
            log.warning("kvtool: the block store was not %s to %s: %s", what, self.cache_file, exc)
            return {}

    def reset(self) -> dict:
        """Empty a private store (its records only); a shared one is kept for the servers sharing it."""
        if self.private is None:
            return {"kept": True, "reason": "the store is shared (--kv-store)"}
        removed = 0
        for key in list(self.store.keys()):
            self.store.discard(key)
            removed += 1
        return {"removed_blocks": removed}

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
        if self.private is not None:
            shutil.rmtree(self.private, ignore_errors=True)


def settle(store, quiet_s: float = 0.3, limit_s: float = 30.0) -> None:
    """Wait until the writers on `store` (the connector's, in vLLM's engine) have published what they queued: its
    block count holds still for quiet_s (at most limit_s)."""
    import time

    end, last, since = time.monotonic() + limit_s, None, time.monotonic()
    while time.monotonic() < end:
        blocks = store.usage()["blocks"]
        if blocks != last:
            last, since = blocks, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return
        time.sleep(0.05)


def mount(model: str, text, kv: EngineConfig, dtype: str) -> Mounted | None:
    """The connector's settings for kvtool's options `kv` (None: nothing to mount). `model` is what kvtool loads
    to compile the skills (in `dtype`, vLLM's too); text: the TextModel (its name goes in the store's layout). A
    cache file saved for another setup raises CacheFormatError naming each difference."""
    if not (kv.skills_dir or kv.kv_store or kv.cache_file):
        return None
    import os

    from kvtool.cache.kvstore import open_store

    name = text.name
    mounted = Mounted({"repair": "none", "skill_min_tokens": kv.skill_min_tokens, "model_name": name,
                       "kv_store_block": kv.prefix_block}, cache_file=kv.cache_file, model_name=name)
    if kv.skills_dir:
        mounted.catalog = compile_catalog(model, kv, dtype)
        mounted.extra["blocks"] = [str(mounted.catalog.paths[n]) for n in mounted.catalog.names()]
    if kv.kv_store or kv.cache_file:
        if kv.kv_store is None:
            mounted.private = tempfile.mkdtemp(prefix="kvtool-store-")
        location = kv.kv_store or mounted.private
        mounted.store = open_store(location, kv.kv_store_bytes)
        mounted.extra.update({"kv_store": location, "kv_store_bytes": kv.kv_store_bytes})
        if kv.cache_file and os.path.exists(kv.cache_file):
            from kvtool.cache.storefile import import_file

            check_file(kv.cache_file, text, dtype)
            done = import_file(kv.cache_file, mounted.store)
            log.info("kvtool: %s blocks of %s imported into the block store", done["blocks"], kv.cache_file)
    return mounted


def check_file(path: str, text, dtype: str) -> None:
    """Refuse a .kvc saved for another model, tokenizer, dtype or RoPE than the one vLLM serves."""
    from kvtool.cache.kvfile import SETUP_FIELDS, setup_mismatches
    from kvtool.cache.persist import open_file
    from kvtool.integrations.vllm.mount import RopeFrame, setup_for
    from kvtool.errors import CacheFormatError

    with open_file(path) as f:
        saved = {k: f.meta.get(k) for k in SETUP_FIELDS}
    diffs = setup_mismatches(saved, setup_for(text.tokenizer, dtype, text.name, RopeFrame(text.hf_config)), "file")
    if diffs:
        raise CacheFormatError(f"{path} was saved for a different setup: " + "; ".join(diffs)
                               + ". Start without --cache-file, or give a file saved for this model.")


def compile_catalog(model: str, kv: EngineConfig, dtype: str):
    """The skills of kv.skills_dir compiled for `model` (kvtool's model loads for it and is released after)."""
    from kvtool.models.loading import load
    from kvtool.skills.catalog import load_catalog

    kmodel = load(model, device="cpu", dtype=dtype, progress=False, packed=False)
    try:
        return load_catalog(kv.skills_dir, kmodel, preamble=kv.skill_preamble).without_kv()
    finally:
        del kmodel
        gc.collect()
