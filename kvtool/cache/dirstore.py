"""The folder block store: one file per block, shared by every process that opens the folder.

    FOLDER/store.json             {"format": "kvtool.block-store", "version": 1, "limit_bytes": N}
    FOLDER/blocks/ab/abcd….kvb    one record (kvtool.cache.blockrecord), named by its key
    FOLDER/blocks/ab/.abcd….tmp   a record being written (or left by a writer that was killed)

Publish: the record goes to a temp file of the writer's own in the block's folder, is fsynced, and os.replace() puts
it in place, so a reader opens the old name's file whole or finds none; two writers of one key replace one whole
file by another with the same content. Recency is a file's mtime, set on write and by touch().

Limit: each process counts what it wrote since it last listed the folder; when that passes a sixteenth of the limit,
or its view of the total passes the limit, it lists the folder, removes temp files older than STALE_S and, if the
total is over the limit, the least recently used records until it is under LOW of it. So the folder stays within the
limit plus a sixteenth of it per writer. Two processes evicting at once remove the same oldest files (a file removed
twice is no error) or a few more than needed; a reader holding a removed file's handle still reads it whole.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Iterator, Sequence

from kvtool.cache.kvstore import KVStore
from kvtool.errors import InvalidParameterError

FORMAT = "kvtool.block-store"
DEFAULT_LIMIT = 16 << 30
LOW = 0.9  # eviction goes down to this fraction of the limit, so the next few writes do not evict again
STALE_S = 600  # a temp file this old was left by a writer that died
SUFFIX = ".kvb"


class DirStore(KVStore):
    def __init__(self, location: str, limit_bytes: int | None = None):
        self.location = location
        self.root = Path(location.removeprefix("file://")).expanduser()
        if self.root.exists() and not self.root.is_dir():
            raise InvalidParameterError(f"kv store {location!r} is a file; give a folder (made if missing)")
        if limit_bytes is not None and (isinstance(limit_bytes, bool) or not isinstance(limit_bytes, int)
                                        or limit_bytes < 1):
            raise InvalidParameterError(f"kv store limit must be an integer >= 1 bytes, got {limit_bytes!r}")
        (self.root / "blocks").mkdir(parents=True, exist_ok=True)
        if limit_bytes is not None or not (self.root / "store.json").is_file():
            self._write_settings(DEFAULT_LIMIT if limit_bytes is None else limit_bytes)
        self._seen_bytes, self._unseen_bytes = self._listing()[0], 0  # the total when last listed, written since

    # ---- settings ---------------------------------------------------------------------------

    def _write_settings(self, limit: int) -> None:
        text = json.dumps({"format": FORMAT, "version": 1, "limit_bytes": limit})
        self._publish(self.root / "store.json", text.encode())

    @property
    def limit_bytes(self) -> int:
        """The folder's limit, as the last process to set it left it (read anew each time)."""
        try:
            settings = json.loads((self.root / "store.json").read_text())
            return int(settings["limit_bytes"]) if settings.get("format") == FORMAT else DEFAULT_LIMIT
        except (OSError, ValueError, KeyError, TypeError):
            return DEFAULT_LIMIT

    # ---- records ----------------------------------------------------------------------------

    def path(self, key: str) -> Path:
        if not key or any(c not in "0123456789abcdef" for c in key):
            raise ValueError(f"DirStore: a key is lowercase hex, got {key!r}")
        return self.root / "blocks" / key[:2] / (key + SUFFIX)

    def get(self, key: str) -> bytes | None:
        try:
            return self.path(key).read_bytes()
        except FileNotFoundError:
            return None

    def held(self, keys: Sequence[str]) -> int:
        for i, key in enumerate(keys):
            if not self.path(key).is_file():
                return i
        return len(keys)

    def put(self, key: str, record: bytes) -> bool:
        path = self.path(key)
        if path.exists():
            return False
        path.parent.mkdir(exist_ok=True)
        self._publish(path, record)
        self._unseen_bytes += len(record)
        if self._seen_bytes + self._unseen_bytes > self.limit_bytes or self._unseen_bytes > self.limit_bytes // 16:
            self.evict()
        return True

    @staticmethod
    def _publish(path: Path, data: bytes) -> None:
        handle, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")  # one per writer
        try:
            with os.fdopen(handle, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(name, path)
        finally:
            if os.path.exists(name):
                os.unlink(name)

    def touch(self, keys: Sequence[str]) -> None:
        now = time.time_ns()
        for i, key in enumerate(keys):  # the first newest: evicting by age takes a chain's leaves first
            try:
                os.utime(self.path(key), ns=(now - i, now - i))
            except FileNotFoundError:
                pass

    def discard(self, key: str) -> None:
        self.path(key).unlink(missing_ok=True)

    def keys(self) -> Iterator[str]:
        for _, _, path in self._files():
            if path.suffix == SUFFIX:
                yield path.stem

    # ---- size -------------------------------------------------------------------------------

    def _files(self) -> Iterator[tuple[int, int, Path]]:
        """(mtime ns, bytes, path) of every file under blocks/, temp files too; files removed meanwhile skipped."""
        try:
            folders = list(os.scandir(self.root / "blocks"))
        except FileNotFoundError:
            return
        for folder in folders:
            try:
                entries = list(os.scandir(folder.path)) if folder.is_dir() else []
            except FileNotFoundError:
                continue
            for entry in entries:
                try:
                    st = entry.stat()
                except FileNotFoundError:
                    continue
                yield st.st_mtime_ns, st.st_size, Path(entry.path)

    def _listing(self) -> tuple[int, list[tuple[int, int, Path]]]:
        files = list(self._files())
        return sum(size for _, size, _ in files), files

    def evict(self) -> int:
        """List the folder; remove stale temp files and, past the limit, the least recently used records down to
        LOW of it. Returns the bytes removed."""
        total, files = self._listing()
        limit, removed, stale = self.limit_bytes, 0, time.time_ns() - STALE_S * 10**9
        records = sorted((f for f in files if f[2].suffix == SUFFIX), key=lambda f: f[0])
        doomed = [f for f in files if f[2].suffix != SUFFIX and f[0] < stale]
        if total > limit:
            left = total - sum(size for _, size, _ in doomed)
            for f in records:
                if left <= LOW * limit:
                    break
                doomed.append(f)
                left -= f[1]
        for _, size, path in doomed:
            try:
                path.unlink()
                removed += size
            except FileNotFoundError:  # another process evicted it first
                pass
        self._seen_bytes, self._unseen_bytes = total - removed, 0
        return removed

    def usage(self) -> dict:
        total, files = self._listing()
        records = [f for f in files if f[2].suffix == SUFFIX]
        return {"backend": "folder", "location": str(self.root), "blocks": len(records),
                "bytes": sum(size for _, size, _ in records), "temp_bytes": total - sum(f[1] for f in records),
                "limit_bytes": self.limit_bytes}
