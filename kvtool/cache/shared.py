"""A prefix cache's blocks in a store other engines share (kvtool.cache.kvstore): what one engine computed, another
on the same store adopts instead of computing it.

SharedBlocks sits beside a PrefixCache (its ``shared``): ``fill`` looks the blocks a prompt lacks in the cache's
own index up in the store, block by block from the first missing one to the first the store lacks too, and imports
the ones found into the cache's pool; ``save`` hands the full blocks a request committed to one writer thread,
which encodes them (kvtool.cache.blockrecord) and publishes them, off the engine's step. A block stays valid while queued: blocks are
immutable once the cache holds them, and the queued reference keeps its pool slot. A store that fails or holds a
bad record costs a miss, counted and warned once, never a request.
"""

from __future__ import annotations

import queue
import threading
import warnings
import weakref
from typing import Sequence

import torch

from kvtool.cache.blockrecord import Layout, decode, encode
from kvtool.cache.kvlog import block_bytes
from kvtool.cache.kvstore import KVStore, open_store
from kvtool.errors import PrefixCacheWarning

TAIL = -1  # in a queued job: the partial block that ends its tokens (Layout.tail_key)
READ_BATCH = 64  # blocks read from the store before they go into the cache
MAX_QUEUED_BLOCKS = 1024  # blocks waiting for the writer; a commit's blocks beyond it are not shared (counted in
# store_dropped_blocks): the chain's first blocks are, so what the store gets is still a prefix


class SharedBlocks:
    def __init__(self, store: KVStore, layout: Layout):
        self.store, self.layout, self.dtype = store, layout, getattr(torch, layout.dtype)
        self.stats = {"store_hit_tokens": 0, "store_written_blocks": 0, "store_dropped_blocks": 0,
                      "store_bad_blocks": 0, "store_errors": 0}
        self._warn = _warner(store.location, self.stats)  # (not a method: the writer thread must not hold self)
        self._queue: queue.Queue = queue.Queue()
        self._room = threading.Semaphore(MAX_QUEUED_BLOCKS)  # one per block the queue may still take
        thread = threading.Thread(target=_write_loop, args=(self._queue, store, layout, self.stats, self._room,
                                                            self._warn), daemon=True, name="kvtool-kv-store")
        thread.start()
        # stop the writer when this goes, and at exit let it finish what is queued
        weakref.finalize(self, _stop, self._queue, thread)

    @classmethod
    def for_cache(cls, location: str, limit_bytes: int | None, setup: dict, block_store) -> "SharedBlocks":
        """The store at ``location`` for blocks shaped as ``block_store``'s (kvtool.cache.store.BlockStore) of the
        model ``setup`` names (kvtool.cache.kvfile.setup_of)."""
        s = block_store
        layout = Layout(setup, s.num_layers, s.num_kv_heads, s.head_dim, str(s.dtype).removeprefix("torch."),
                        s.block_size)
        return cls(open_store(location, limit_bytes), layout)

    def read(self, key: str, tokens: Sequence[int]) -> torch.Tensor | None:
        """The block [2, L, H, B, D] stored under ``key`` if it holds ``tokens`` in this layout; else None (a bad
        record is removed)."""
        try:
            record = self.store.get(key)
        except Exception as exc:  # the store went away: a miss
            self._warn("reading", exc)
            return None
        found = decode(record, key)
        shape = self.layout.shape
        if found is not None and found[0].get("tokens") == list(tokens) and \
                found[0].get("layout") == self.layout.describe() and \
                found[1].nbytes == torch.Size(shape).numel() * self.dtype.itemsize:
            return torch.frombuffer(bytearray(found[1]), dtype=self.dtype).reshape(shape)
        if record is not None:
            self.stats["store_bad_blocks"] += 1
            try:
                self.store.discard(key)
            except Exception as exc:
                self._warn("removing a bad block", exc)
        return None

    def fill(self, cache, tokens: Sequence[int], ids: list[int]) -> list[int]:
        """Import into ``cache`` (a PrefixCache, its lock held) the stored blocks of ``tokens`` after the ``ids`` it
        holds; the ids of the chain it holds then."""
        bs, start = self.layout.block_size, len(ids)
        keys, end = self.layout.keys(tokens), start
        while end < len(keys):  # READ_BATCH blocks at a time: a long prompt's blocks are not all held at once
            found: list[torch.Tensor] = []
            while end + len(found) < len(keys) and len(found) < READ_BATCH:
                i = end + len(found)
                if (kv := self.read(keys[i], tokens[i * bs : (i + 1) * bs])) is None:
                    break
                found.append(kv)
            if not found:
                break
            reached = end + len(found)
            got = cache.import_chain(list(tokens[: reached * bs]), lambda i, at=end: tuple(found[i - at]))
            end = min(reached, got // bs)
            if len(found) < READ_BATCH or end < reached:  # the store's chain ends, or the cache's budget is full
                break
        if end > start:
            self.stats["store_hit_tokens"] += (end - start) * bs
            try:
                self.store.touch(keys[:end])
            except Exception as exc:
                self._warn("touching", exc)
        return cache.index.match(list(tokens), record=False)

    def save(self, tokens: Sequence[int], new: list[tuple[int, int]], block_store) -> None:
        """Queue the blocks ``new`` = [(block index in tokens, block id in block_store)] for the store."""
        if not (new := sorted(new)[:self._room_for(len(new))]):
            return
        blocks = block_store.tensors([block_id for _, block_id in new])
        end = (new[-1][0] + 1) * self.layout.block_size
        self._queue.put((list(tokens[:end]), [(i, kv) for (i, _), kv in zip(new, blocks)]))

    def queue(self, tokens: Sequence[int], blocks: list[tuple[int, torch.Tensor]]) -> int:
        """Queue KV [2, L, H, B, D] for the store: (i, kv) for the i-th whole block of ``tokens``, (TAIL, kv) for the
        partial block that ends them (zero past the tail). Returns the blocks queued (the rest are dropped, counted:
        the writer is behind)."""
        if room := self._room_for(len(blocks)):
            self._queue.put((list(tokens), blocks[:room]))
        return room

    def _room_for(self, n: int) -> int:
        """How many of n more blocks the queue takes now; the others are counted as dropped."""
        room = 0
        while room < n and self._room.acquire(blocking=False):
            room += 1
        self.stats["store_dropped_blocks"] += n - room
        return room

    def flush(self) -> None:
        """Wait until every queued block is written."""
        self._queue.join()


def _warner(location: str, stats: dict):
    warned: set[str] = set()

    def warn(what: str, exc: BaseException) -> None:
        stats["store_errors"] += 1
        if what not in warned:
            warned.add(what)
            warnings.warn(PrefixCacheWarning(f"kv store {location}: {what} failed ({type(exc).__name__}: {exc}); "
                                             "those blocks are computed instead (warned once)"))

    return warn


def describe_store(store: KVStore) -> dict:
    """What ``store`` holds (no model needed): its usage, and per layout (model, dtype, shape) the blocks, tokens
    and bytes, how many chains start there and how many blocks lost their parent to eviction; damaged records."""
    layouts: dict[str, dict] = {}
    parents, damaged = {}, 0
    for key in list(store.keys()):
        found = decode(record := store.get(key), key)
        if found is None:
            damaged += record is not None  # (None: evicted during the walk)
            continue
        header = found[0]
        d = header["layout"]
        row = layouts.setdefault(Layout.from_dict(d).root.hex(), {
            "model": d["setup"].get("model"), "dtype": d["dtype"], "layers": d["num_layers"],
            "kv_heads": d["num_kv_heads"], "heads": d["heads"], "head_dim": d["head_dim"],
            "block_size": d["block_size"], "setup": d["setup"], "blocks": 0, "tokens": 0, "bytes": 0, "roots": 0,
            "orphans": 0})
        row["blocks"] += 1
        row["tokens"] += len(header["tokens"])
        row["bytes"] += len(record)
        parents[key] = (row, header["parent"])
    for row, parent in parents.values():
        row["roots" if parent is None else "orphans"] += parent is None or parent not in parents
    return {**store.usage(), "layouts": list(layouts.values()), "damaged": damaged}


def _write_loop(jobs: queue.Queue, store: KVStore, layout: Layout, stats: dict, room: threading.Semaphore,
                warn) -> None:
    while (job := jobs.get()) is not None:
        tokens, blocks = job
        try:
            write(store, layout, stats, tokens, blocks)
        except Exception as exc:
            warn("writing", exc)
        finally:
            room.release(len(blocks))
            jobs.task_done()
    jobs.task_done()


def write(store: KVStore, layout: Layout, stats: dict, tokens: Sequence[int], blocks) -> None:
    """Publish blocks [(i, kv)] of ``tokens`` (as SharedBlocks.queue takes them) to ``store``, now."""
    keys, bs = layout.keys(tokens), layout.block_size
    for i, kv in blocks:
        if i == TAIL:
            key, parent, held = layout.tail_key(tokens), keys[-1] if keys else None, tokens[len(keys) * bs:]
        else:
            key, parent, held = keys[i], keys[i - 1] if i else None, tokens[i * bs : (i + 1) * bs]
        stats["store_written_blocks"] += store.put(key, encode(layout, key, parent, held, block_bytes(kv)))
    store.touch(keys)


def _stop(jobs: queue.Queue, thread: threading.Thread) -> None:
    jobs.put(None)
    thread.join(timeout=60)
