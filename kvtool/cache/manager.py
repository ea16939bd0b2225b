"""PrefixCache: reuse KV across requests. PrefixIndex decides, BlockStore holds the tensors.

It is the Engine's ``prefix_cache`` hook:
- ``prepare(prompt_ids, runner)`` matches the longest cached chain of full blocks of ``prompt_ids[:-1]`` (the last
  token is always computed, for its logits) and, after it, the leading tokens a cached block shares with the rest
  (PrefixIndex.match_tail), and holds them. The request's KVCache is paged (kvtool.cache.kv): it reads the full
  blocks in place and copies only the partly reused block, into its page; the C++ CPU ops (and skill splicing)
  write its new tokens into further blocks, the reference forward copies all into buffers of its own first. Blocks
  are immutable and a request writes only its own, so two requests with one prefix cannot see each other's suffix.
- ``commit(handle, token_ids, cache)`` inserts the full blocks of what the request computed (prompt and decoded
  tokens), keeps a paged cache's new full blocks as they are (no copy; other caches' KV is copied into new blocks)
  and drops the hold. It never raises because of caching, and tolerates aborted requests and a reset() in between.
- ``publish(handle, token_ids, cache)`` inserts the same way but keeps the hold: the batch scheduler calls it when a
  prompt's prefill ends, so requests that arrive while that one still decodes reuse its prompt (vLLM shares a block
  once it is full, too); commit() later adds only the blocks that are new by then.
- ``fork(cache, token_ids, runner)`` (optional for a hook) copies a prefilled prompt's KV for each of its n
  choices: on the C++ CPU path the copy reads the prompt's full blocks in place (and holds the cached ones).

Memory: the store holds at most ``budget_bytes // bytes_per_block`` blocks; eviction is the index's (LRU by
default). A request whose KV does not fit runs (partly) uncached, with a warning. The blocks come from a BlockPool
(an Engine's: the one count of its KV memory), which evicts a block no request holds or pins (``_reclaim``) before
it refuses one. One lock guards index and store: the engine worker and HTTP handlers (pin, reset, stats) may call in
from different threads.
"""

from __future__ import annotations

import os
import threading
import warnings
import weakref
from dataclasses import dataclass
from typing import Sequence

import torch

from kvtool.cache.hook import PrefixHook
from kvtool.cache.index import PrefixIndex
from kvtool.cache.kv import KVCache
from kvtool.cache.kvfile import setup_of
from kvtool.cache.persist import load_cache, save_cache
from kvtool.cache.shared import SharedBlocks
from kvtool.cache.store import BlockPool, BlockStore, memory_split
from kvtool.config import is_whole
from kvtool.errors import InvalidParameterError, PoolExhausted, PrefixCacheWarning
from kvtool.ids import as_token_ids

@dataclass
class PrefixHandle:
    block_ids: list[int]  # held chain, released by commit()
    cached_tokens: int
    epoch: int  # reset() count at prepare time; KV from before a reset is not inserted after it
    done: bool = False


class PrefixCache(PrefixHook):
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, *, budget_bytes: int,
                 block_size: int = 16, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 eviction: str = "lru", runner=None, pool: BlockPool | None = None):
        if not is_whole(block_size, 1):
            raise InvalidParameterError(f"prefix cache block_size must be an integer >= 1 tokens, got {block_size!r}")
        self.store = BlockStore(num_layers, num_kv_heads, head_dim, block_size, dtype, device, pool)
        self.index = PrefixIndex(block_size, self._capacity(budget_bytes), eviction)
        self.budget_bytes, self.block_size = budget_bytes, block_size
        self.runner = runner  # computes KV for pin() of a prefix that is not cached yet
        self._lock, self._epoch = threading.RLock(), 0  # (_epoch: reset() count)
        self._queries = self._query_tokens = self._hit_tokens = self._copied_tokens = 0
        self._over_budget, self._warned = 0, False  # requests (or pins) whose KV did not fit, and the warning
        self._changes = 0  # what a cache file would hold moved on (blocks, pins, order of use): see `changes`
        self.loaded = self.shared = None  # what the last load() added; a store other engines share (SharedBlocks)
        self.store.pool.reclaim = weakref.WeakMethod(self._reclaim)  # a full pool first evicts what no request holds

    @classmethod
    def for_runner(cls, runner, budget_bytes: int | None = None, block_size: int = 16,
                   eviction: str = "lru", pool: BlockPool | None = None) -> "PrefixCache":
        """A cache shaped for ``runner``'s KV (layers, heads, dtype, device; ``pool``'s dtype where given); its blocks
        and the requests' pages come from ``pool`` (e.g. its Engine's), else each is an allocation of its own."""
        s = runner.spec
        budget = memory_split(None, None, runner.device)[1] if budget_bytes is None else budget_bytes
        return cls(s.num_layers, s.num_kv_heads, s.head_dim, budget_bytes=budget, block_size=block_size,
                   dtype=(pool or runner).dtype, device=runner.device, eviction=eviction, runner=runner, pool=pool)

    def _capacity(self, budget_bytes) -> int:
        if not is_whole(budget_bytes):
            raise InvalidParameterError(f"prefix cache budget must be an int >= 0 bytes, got {budget_bytes!r}")
        return budget_bytes // self.store.bytes_per_block

    def _reclaim(self) -> bool:  # the pool is full: evict a block no request holds or pins (False: none is left)
        with self._lock:
            self.store.free(evicted := self.index.evict_lru(1))
            self._changes += bool(evicted)
            return bool(evicted)

    # ---- the engine hook -------------------------------------------------------------------

    def prepare(self, prompt_ids: Sequence[int], runner) -> tuple[KVCache, int, PrefixHandle]:
        prompt_ids = list(prompt_ids)
        with self._lock:
            ids = self.index.match(prompt_ids[:-1], record=False)
            if self.shared is not None:  # the blocks the index lacks, from what other engines stored
                ids = self.shared.fill(self, prompt_ids[:-1], ids)
            tail = self.index.match_tail(prompt_ids[:-1], ids)  # (block, k): a slice of one more block
            held = ids + [tail[0]] if tail else ids  # held while read: no eviction under the reader
            self.index.acquire(held)
            n, k = len(ids) * self.block_size + (tail[1] if tail else 0), tail[1] if tail else 0
            try:  # a paged cache: the full blocks are read in place, the partly reused one is copied into its page
                cache = KVCache.paged(self.store.tensors(ids), self.store.page(tail), k, n - k, self.store.take)
            except BaseException:
                self.store.free(self.index.release(held))
                raise
            self._queries += 1
            self._query_tokens += len(prompt_ids)
            self._hit_tokens += n
            # the C++ CPU ops read and write the blocks; the reference forward first copies them into its own buffers
            self._copied_tokens += k if getattr(runner, "cpu_decode", False) else n
        return cache, n, PrefixHandle(held, n, self._epoch)

    def commit(self, handle: PrefixHandle | None, token_ids: Sequence[int], cache: KVCache) -> None:
        """Cache the KV a request computed and release its hold. Idempotent per handle."""
        if handle is None or handle.done:
            return
        handle.done = True
        with self._lock:
            try:
                self._insert_safely(handle, token_ids, cache, final=True)
            finally:
                self.store.free(self.index.release(handle.block_ids))

    def publish(self, handle: PrefixHandle | None, token_ids: Sequence[int], cache: KVCache) -> None:
        """Cache the KV a running request has computed so far (e.g. its prompt); it keeps its hold."""
        if handle is None or handle.done:
            return
        with self._lock:
            self._insert_safely(handle, token_ids, cache, final=False)

    def fork(self, cache: KVCache, token_ids: Sequence[int], runner) -> tuple[KVCache, PrefixHandle | None]:
        """(a copy of `cache`, which holds the KV of `token_ids`, for one of the n choices of that prompt, a handle):
        from a paged cache (the C++ CPU path) one that reads the same full blocks in place (the cached ones held
        until commit(), as a hit's) and copies only the page; from any other a whole copy."""
        first = cache.layers[0]
        if first.page is None:  # nothing of the prefix cache's to hold: KVCache.fork copies it whole
            return cache.fork(), None
        with self._lock:
            ids = self.index.match(list(token_ids)[: first.base], record=False)
            self.index.acquire(ids)
            blocks, shared = self.store.tensors(ids), len(ids) * self.block_size
            try:  # (a full pool refuses the copy's page: the hold ends with it)
                return cache.fork(blocks, shared), PrefixHandle(ids, shared, self._epoch)
            except PoolExhausted:
                self.store.free(self.index.release(ids))
                raise

    def _insert_safely(self, handle: PrefixHandle, token_ids: Sequence[int], cache: KVCache, final: bool) -> None:
        try:
            if handle.epoch == self._epoch:
                self._insert(list(token_ids), cache, what="request", count=final)
        except Exception as exc:  # caching must never fail a request; drop what may be inconsistent
            warnings.warn(PrefixCacheWarning(f"prefix cache: storing a request's KV failed "
                                             f"({type(exc).__name__}: {exc}); the cache was reset"))
            self._reset_locked()

    def _insert(self, tokens: list[int], cache: KVCache, what: str, count: bool = True) -> int:
        """Insert the full blocks of ``tokens`` whose KV ``cache`` holds; returns cached tokens. count: whether
        a shortfall counts as one over-budget request (a request that publishes first counts at commit)."""
        bs = self.block_size
        n = min((layer.offset for layer in cache.layers), default=0)  # an aborted prefill may leave layers uneven
        tokens, page = tokens[:n], cache.layers[0].page if cache.layers else None
        if paged := page is not None and all(layer.page is page for layer in cache.layers):
            try:
                cache.reserve(cache.offset + 1)  # a full page joins the blocks
            except PoolExhausted:  # (no fresh page for it: its tokens stay uncached)
                tokens = tokens[: cache.layers[0].base]
        result = self.index.insert(tokens)
        self.store.free(result.evicted)  # before put(): the store never holds more than the budget
        self._changes += 1  # new blocks, or known ones moved to the back of the eviction order
        own = cache.layers[0].blocks if paged else []  # kept as they are: commit copies none of them
        copied = [(i, block_id) for i, block_id in result.new if i >= len(own)]  # the chain's tail: one copy out
        keys, values = cache.stacked(copied[0][0] * bs, (copied[-1][0] + 1) * bs) if copied else (None, None)
        for i, block_id in result.new:
            if i < len(own):
                self.store.adopt(block_id, own[i])
            else:
                s = (i - copied[0][0]) * bs
                self.store.put(block_id, keys[:, :, s : s + bs], values[:, :, s : s + bs])
        if self.shared is not None:
            self.shared.save(tokens, result.new, self.store)
        cached = len(result.block_ids) * bs
        if cached < len(tokens) // bs * bs and count:
            self._over_budget += 1
            if not self._warned:
                self._warned = True
                warnings.warn(PrefixCacheWarning(
                    f"prefix cache: a {what}'s KV ({len(tokens)} tokens, "
                    f"{len(tokens) // bs * self.store.bytes_per_block:,} bytes) does not fit the cache budget "
                    f"({self.budget_bytes:,} bytes = {self.index.capacity_blocks} blocks of {bs} tokens, "
                    f"not counting pinned or in-use blocks); only its first {cached} tokens are cached and the "
                    f"rest runs uncached. Raise the budget (--cache-bytes / EngineConfig.cache_bytes) to reuse "
                    f"it whole. (Warned once; see stats()['over_budget'].)"), stacklevel=3)
        return cached

    # ---- Python API ------------------------------------------------------------------------

    def pin(self, token_ids: Sequence[int]) -> dict:
        """Keep the full blocks of ``token_ids`` (e.g. system prompt + tools) cached until unpin()
        or reset(). Missing KV is computed with ``self.runner`` on the calling thread."""
        tokens = as_token_ids(token_ids, "pin() token_ids")
        full = len(tokens) // self.block_size * self.block_size
        if not full:
            raise InvalidParameterError(f"pin: {len(tokens)} tokens are less than one cache block "
                                        f"({self.block_size} tokens); nothing could be pinned")
        with self._lock:
            ids = self.index.match(tokens[:full], record=False)
            self.index.acquire(ids)
            epoch = self._epoch
        try:
            cache = None
            done = len(ids) * self.block_size
            if done < full:
                if self.runner is None:
                    raise InvalidParameterError("pin: the prefix is not cached and this PrefixCache has no runner "
                                                "to compute it; build it with PrefixCache.for_runner()")
                with self._lock:
                    cache = KVCache.paged(self.store.tensors(ids), self.store.page(None), 0, done, self.store.take)
                self.runner.prefill(tokens[done:full], cache, logits="none")
            with self._lock:
                if cache is not None and epoch == self._epoch:
                    self._insert(tokens[:full], cache, what="pinned prefix")
                pinned = self.index.pin_prefix(tokens[:full])
                self._changes += 1
        finally:
            with self._lock:
                self.store.free(self.index.release(ids))
        return {"tokens": len(tokens), "pinned_tokens": pinned, "unpinned_tail_tokens": len(tokens) - pinned}

    def unpin(self, token_ids: Sequence[int]) -> dict:
        """Undo the latest pin() of the same tokens; the blocks become evictable again."""
        tokens = as_token_ids(token_ids, "unpin() token_ids")
        with self._lock:
            try:
                freed = self.index.unpin_prefix(tokens)
            except ValueError as exc:
                raise InvalidParameterError(str(exc)) from None
            self.store.free(freed)
            self._changes += 1
        return {"tokens": len(tokens), "unpinned_tokens": len(tokens) // self.block_size * self.block_size}

    def reset(self) -> dict:
        """Drop every cached block and pin. Running requests keep their own KV and stay correct;
        what they compute is not inserted (it belongs to before the reset)."""
        with self._lock:
            return {"freed_blocks": self._reset_locked()}

    def _reset_locked(self) -> int:
        freed = self.index.reset()
        # After a failed commit the index may name blocks whose put() never happened, and the
        # store may hold a put() the index lost: free by what the store really holds.
        orphans = self.store.ids() - self.index.resident_ids()
        self.store.free(orphans)
        self._epoch += 1
        self._changes += 1
        return len(freed)

    def save(self, path, model=None) -> dict:
        """Write every cached prefix's KV and pins to ``path`` (a .kvc file, kvtool.cache.persist), for load()
        in a later process with the same model. ``model``: the LoadedModel this cache serves (its name and
        tokenizer go into the file's setup); None for a bare runner."""
        return save_cache(self, path, setup_of(model, self.runner))

    def load(self, path, model=None) -> dict:
        """Add the prefixes a save() wrote to this cache; a file made for another setup is refused."""
        self.loaded = load_cache(self, path, setup_of(model, self.runner))
        return self.loaded

    def tree(self) -> list[dict]:
        """What is cached, as a tree of segments: shared prefixes and where requests diverge (kvtool.cache.tree)."""
        from kvtool.cache.tree import segments

        with self._lock:
            return segments(self.index.snapshot()[0], self.block_size)

    def export_blocks(self):
        """A consistent snapshot for saving: [(id, parent, tokens, last_used)] of the live blocks, parents first;
        the pinned token keys; each block's KV tensor [2, L, H, B, D] (the store's own, not copies)."""
        with self._lock:
            blocks, pins = self.index.snapshot()
            rows = [(b.id, b.parent, b.tokens, b.last_used) for b in blocks]
            return rows, pins, self.store.tensors([b.id for b in blocks])

    def import_chain(self, tokens: list[int], block_kv, pin: Sequence[int] | None = None) -> int:
        """Cache the full blocks of ``tokens``; ``block_kv(i)`` gives (keys, values) [L, H, B, D] of block i, asked
        only for blocks not cached yet. Then pin_prefix(pin), if given. Returns the tokens cached (fewer when
        the budget is full of pinned or in-use blocks)."""
        with self._lock:
            result = self.index.insert(tokens)
            self.store.free(result.evicted)
            self._changes += 1
            for i, block_id in result.new:
                self.store.put(block_id, *block_kv(i))
            if pin is not None:
                self.index.pin_prefix(pin)
            return len(result.block_ids) * self.block_size

    def cached_tokens(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens of ``token_ids`` the cache holds (whole blocks); touches them, as a hit would."""
        with self._lock:
            return len(self.index.match(list(token_ids), record=False)) * self.block_size

    def set_budget(self, budget_bytes: int) -> None:
        with self._lock:
            capacity = self._capacity(budget_bytes)
            self.budget_bytes = budget_bytes
            self.store.free(self.index.set_capacity(capacity))
            self._changes += 1

    @property
    def changes(self) -> int:
        """Grows whenever what save() would write moves on; equal counts mean nothing new to save."""
        return self._changes

    def stats(self) -> dict:
        with self._lock:
            return {
                "queries": self._queries, "query_tokens": self._query_tokens, "hit_tokens": self._hit_tokens,
                "hit_rate": self._hit_tokens / self._query_tokens if self._query_tokens else 0.0,
                "copied_tokens": self._copied_tokens,  # of hit_tokens, copied into the request's own KV
                "evictions": self.index.stats.evictions, "inserted_blocks": self.index.stats.inserted_blocks,
                "bytes_in_use": self.store.nbytes, "budget_bytes": self.budget_bytes,
                "blocks": self.index.num_blocks, "capacity_blocks": self.index.capacity_blocks,
                "pinned_blocks": self.index.pinned_blocks, "block_size": self.block_size,
                "bytes_per_block": self.store.bytes_per_block, "over_budget": self._over_budget,
                "pool_blocks": self.store.pool.blocks, "pool_blocks_spare": len(self.store.pool.spare),
                "resets": self._epoch, "eviction": self.index.eviction, **(self.shared.stats if self.shared else {}),
            }

    def prometheus_lines(self, prefix: str = "kvtool_prefix_cache") -> list[str]:
        """Prometheus text-format lines for /metrics."""
        s = self.stats()
        metrics = [
            ("queries_total", "counter", "requests that looked up the prefix cache", s["queries"]),
            ("query_tokens_total", "counter", "prompt tokens of those requests", s["query_tokens"]),
            ("hit_tokens_total", "counter", "prompt tokens served from the cache", s["hit_tokens"]),
            ("hit_rate", "gauge", "hit_tokens_total / query_tokens_total", s["hit_rate"]),
            ("evictions_total", "counter", "blocks evicted to stay under the budget", s["evictions"]),
            ("bytes_in_use", "gauge", "bytes of KV held by the cache", s["bytes_in_use"]),
            ("budget_bytes", "gauge", "byte budget of the cache", s["budget_bytes"]),
            ("blocks", "gauge", "KV blocks held", s["blocks"]),
            ("pinned_blocks", "gauge", "blocks pinned permanently", s["pinned_blocks"]),
            ("over_budget_total", "counter", "requests whose KV did not fit the budget", s["over_budget"]),
            ("resets_total", "counter", "cache resets", s["resets"]),
        ]
        return [line for name, kind, help_text, value in metrics for line in (
            f"# HELP {prefix}_{name} {help_text}", f"# TYPE {prefix}_{name} {kind}", f"{prefix}_{name} {value}")]

    def check_integrity(self) -> None:
        """Raise AssertionError if index and store disagree or either is inconsistent."""
        with self._lock:
            self.index.check_integrity()
            self.store.check_integrity()
            assert self.store.ids() == self.index.resident_ids(), "store and index hold different blocks"
            assert self._hit_tokens <= self._query_tokens


def attach_prefix_cache(engine, budget_bytes: int | None = None, block_size: int | None = None,
                        eviction: str = "lru") -> PrefixCache | None:
    """Give ``engine`` a PrefixCache per its EngineConfig (None, and no cache, if disabled), holding what
    EngineConfig.cache_file saved, if that file exists."""
    cfg = engine.config
    if not cfg.enable_prefix_cache:
        engine.prefix_cache = None
        return None
    budget, size = budget_bytes if budget_bytes is not None else engine.memory[1], block_size or cfg.prefix_block
    pool = engine.memory[0] + budget if engine.paged else 0  # the paged requests' and the cache's
    if (engine.pool.block_shape[3], engine.pool.blocks) != (size, pool // engine.pool.bytes_per_block):
        engine.pool = BlockPool.for_runner(engine.runner, size, pool, engine.pool.dtype)  # (requests keep theirs)
    cache = PrefixCache.for_runner(engine.runner, budget, size, eviction, engine.pool)
    if cfg.kv_store is not None:
        setup = setup_of(engine.model, engine.runner)
        cache.shared = SharedBlocks.for_cache(cfg.kv_store, cfg.kv_store_bytes, setup, cache.store)
    if cfg.cache_file is not None and os.path.exists(cfg.cache_file):
        cache.load(cfg.cache_file, engine.model)
    engine.prefix_cache = cache
    return cache
