"""A block store that several engines (processes, machines) read and write at once: the interface and its registry.

A store maps a block's key (kvtool.cache.blockrecord: a chain hash of the tokens, the model and the layout) to the
block's record. A backend publishes each record atomically (a reader sees it whole or not at all), keeps its bytes
under a limit by evicting the least recently used, and treats two writers of one key as harmless (a key names one
content). It knows nothing of tensors: records are bytes, checked by whoever decodes them.

Backends register by location scheme: a folder path (kvtool.cache.dirstore, the embedded default) or
``redis://host:port/db`` (kvtool.cache.redisstore, for Redis or Valkey).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import Iterator, Sequence

from kvtool.errors import InvalidParameterError

# scheme -> "module:class"; a location without "scheme://" is a folder
BACKENDS = {"file": "kvtool.cache.dirstore:DirStore", "redis": "kvtool.cache.redisstore:RedisStore"}


class KVStore(ABC):
    """Records by key. Every call is safe with other processes using the same store at the same time."""

    location: str

    @abstractmethod
    def get(self, key: str) -> bytes | None:
        """The record stored under ``key``, or None (never stored, evicted, or being removed)."""

    @abstractmethod
    def put(self, key: str, record: bytes) -> bool:
        """Publish ``record`` under ``key`` atomically; False (and nothing written) when the key is there already."""

    def held(self, keys: Sequence[str]) -> int:
        """How many of ``keys``, from the first, are stored now (a chain's run; no record is read whole)."""
        for i, key in enumerate(keys):
            if self.get(key) is None:
                return i
        return len(keys)

    @abstractmethod
    def touch(self, keys: Sequence[str]) -> None:
        """Mark ``keys`` used now, the first the most recently (a chain root first, so its leaves evict first)."""

    @abstractmethod
    def discard(self, key: str) -> None:
        """Remove ``key``'s record (a reader found it bad); a missing key is no error."""

    @abstractmethod
    def keys(self) -> Iterator[str]:
        """Every key stored now (a snapshot while others write: keys may come and go during the walk)."""

    @abstractmethod
    def usage(self) -> dict:
        """{"blocks", "bytes", "limit_bytes", "backend", "location"} of the store now."""

    def check_integrity(self) -> None:
        """Raise AssertionError if a published record is not whole under its own key."""
        from kvtool.cache.blockrecord import decode

        for key in list(self.keys()):
            record = self.get(key)
            assert record is None or decode(record, key) is not None, f"{self.location}: record {key} is damaged"

    def close(self) -> None:
        """Release connections or handles; the stored records stay."""


def open_store(location: str, limit_bytes: int | None = None) -> KVStore:
    """The store at ``location``: a folder (made if missing) or ``redis://host:port/db``. limit_bytes: the folder
    store's byte limit, kept in the folder for every process using it (None: keep the folder's own, or the
    default); a Redis server's limit is its own maxmemory setting."""
    if not isinstance(location, str) or not location:
        raise InvalidParameterError(f"kv store: the location must be a folder or redis://host:port/db, got "
                                    f"{location!r}")
    scheme = location.split("://", 1)[0] if "://" in location else "file"
    if scheme not in BACKENDS:
        raise InvalidParameterError(f"kv store {location!r}: no backend for {scheme}://; use a folder path or one of "
                                    + ", ".join(f"{s}://" for s in BACKENDS if s != "file"))
    module, cls = BACKENDS[scheme].split(":")
    return getattr(importlib.import_module(module), cls)(location, limit_bytes)
