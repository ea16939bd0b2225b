"""Prefix-cache files saved incrementally (format version 2): a save writes only the blocks added since the last one,
and a crash at any moment leaves the last completed save whole.

Two files sit side by side; users name only the first:

    PATH                 the manifest: a checked KV file (kvtool.cache.kvfile) holding the index
                         (tokens, parents, recency, pins as in version 1) plus, per block, its offset in
                         the data file and the sha256 of its bytes; its metadata names the data file and
                         the length of it the manifest covers (data_bytes).
    PATH.<id>.data       append-only: each block's KV [2, L, H, B, D] as raw bytes, one after the other.

A save appends the new blocks to the data file, syncs it, then replaces the manifest atomically (temp file, sync,
rename). Killed mid-append, the data file has a tail the manifest does not cover: loading warns and ignores it, the
next save cuts it off. Blocks evicted since they were written stay in the data file as dead bytes until they pass
COMPACT_SHARE of it; that save writes the live blocks to a new data file, points a new manifest at it and deletes
the old one. A save that would write the same blocks and pins as the last (only hits happened since) writes nothing.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import threading
import time
import warnings
import weakref
from pathlib import Path

import torch

from kvtool.cache.kvfile import CheckedFile, write_checked
from kvtool.errors import CacheFormatError, PrefixCacheWarning

VERSION = "2"
COMPACT_SHARE = 0.5  # dead bytes over this share of the data file: the next save compacts it
_WRITERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # PrefixCache -> {path: Writer}
_WRITERS_LOCK = threading.Lock()


def chain_keys(rows: list[list[int]], parents: list[int]) -> list[bytes]:
    """A key per block that names its whole prefix (parent's key + its tokens); parents come first."""
    keys: list[bytes] = []
    for tokens, parent in zip(rows, parents):
        h = hashlib.blake2b(keys[parent] if parent >= 0 else b"", digest_size=16)
        h.update(torch.tensor(tokens, dtype=torch.int64).numpy().tobytes())
        keys.append(h.digest())
    return keys


def block_bytes(kv: torch.Tensor):
    """A block's KV as the bytes the data file holds (a view, no copy for a contiguous CPU tensor)."""
    return kv.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


def data_path(path: Path, meta: dict) -> Path:
    return path.parent / meta["data_file"]


class Writer:
    """What one cache has saved to one path: the data file, how much of it the manifest covers, and where each
    saved block is (by chain key). Re-read from the manifest when another writer replaced it."""

    def __init__(self, path: Path):
        self.path, self.lock = path, threading.Lock()
        self.data_name: str | None = None
        self.data_bytes = 0
        self.entries: dict[bytes, tuple[int, bytes]] = {}  # chain key -> (offset, sha256)
        self.saved: tuple | None = None  # (keys, pins) of the last save
        self.manifest_stat: tuple | None = None  # the manifest as this writer left it
        self.stale: Path | None = None  # a data file no manifest will name once this writer's first save is in

    def adopt(self, layout: dict, read) -> None:
        """Take over the data file of a version-2 manifest at self.path made for the same layout; else start
        a new data file at the first save (the old manifest's data file is deleted once it is replaced).
        read(path) -> (metadata, index with offsets and sha256) of a version-2 manifest, or None."""
        self.data_name, self.data_bytes, self.entries, self.saved, self.stale = None, 0, {}, None, None
        if not self.path.is_file():
            return
        try:
            found = read(self.path)
        except CacheFormatError:
            return  # replaced whole by the first save
        if found is None:
            return
        meta, saved = found
        old = data_path(self.path, meta)
        if any(meta.get(k) != str(v) for k, v in layout.items()) or not old.is_file() or \
                old.stat().st_size < int(meta["data_bytes"]):
            self.stale = old
            return
        keys = chain_keys(saved["rows"], saved["parents"])
        self.entries = {k: (o, s) for k, o, s in zip(keys, saved["offsets"], saved["sha256"])}
        self.data_name, self.data_bytes = meta["data_file"], int(meta["data_bytes"])
        self.manifest_stat = stat_of(self.path)


def stat_of(path: Path) -> tuple | None:
    try:
        s = path.stat()
    except OSError:
        return None
    return (s.st_ino, s.st_size, s.st_mtime_ns)


def writer_for(cache, path: Path, layout: dict, read) -> Writer:
    with _WRITERS_LOCK:
        writers = _WRITERS.setdefault(cache, {})
        writer = writers.get(path)
        if writer is None:
            writer = writers[path] = Writer(path)
            writer.adopt(layout, read)
    return writer


def save_incremental(cache, path: str | Path, index: dict, kv: list[torch.Tensor], meta: dict, read) -> dict:
    """Save a snapshot (index: tokens/parents/recency/pin tensors and rows, parents, pins lists; kv: one
    tensor per block) to ``path``, writing only what the data file lacks (read: see Writer.adopt). Returns
    what was saved and written_bytes."""
    start = time.perf_counter()
    path = Path(path).absolute()
    layout = {k: meta[k] for k in ("block_size", "kv_dtype", "kv_shape", *SETUP_KEYS) if k in meta}
    writer = writer_for(cache, path, layout, read)
    with writer.lock:
        if writer.manifest_stat is not None and stat_of(path) != writer.manifest_stat:
            writer.adopt(layout, read)  # another process saved to this path since: continue from its manifest
        keys = chain_keys(index["rows"], index["parents"])
        state = (keys, index["pins"])
        n, size = len(keys), (block_bytes(kv[0]).nbytes if kv else 0)
        if writer.saved == state and writer.data_name is not None:
            return summary(path, writer, n, index, 0, start, unchanged=True)
        new = [j for j, k in enumerate(keys) if k not in writer.entries]
        total = writer.data_bytes + len(new) * size
        compact = writer.data_name is None or (total and (total - n * size) / total > COMPACT_SHARE)
        old, before = None, (writer.data_name, writer.data_bytes, dict(writer.entries))
        if compact:
            old = path.parent / writer.data_name if writer.data_name else writer.stale
            writer.data_name, writer.data_bytes, writer.entries = f"{path.name}.{secrets.token_hex(4)}.data", 0, {}
            new = list(range(n))
        try:
            written = append_blocks(path.parent / writer.data_name, writer, [(keys[j], kv[j]) for j in new])
            offsets = [writer.entries[k][0] for k in keys]
            digests = [writer.entries[k][1] for k in keys]
            tensors = {**index["tensors"], "offsets": torch.tensor(offsets, dtype=torch.int64),
                       "sha256": torch.tensor(list(b"".join(digests)), dtype=torch.uint8).reshape(n, 32)}
            full = {**meta, "format_version": VERSION, "data_file": writer.data_name,
                    "data_bytes": writer.data_bytes, "block_bytes": size}
            write_checked(path, tensors, full, sync=True)
        except BaseException:  # the last manifest stands: forget what this save appended (the next cuts it off)
            if compact:
                (path.parent / writer.data_name).unlink(missing_ok=True)
            writer.data_name, writer.data_bytes, writer.entries = before
            raise
        writer.manifest_stat, writer.saved, writer.stale = stat_of(path), state, None
        if old is not None and old.name != writer.data_name:
            old.unlink(missing_ok=True)
        written += path.stat().st_size
        return summary(path, writer, n, index, written, start, compacted=bool(compact))


SETUP_KEYS = ("model", "config_hash", "tokenizer_hash", "dtype", "rope")


def append_blocks(data: Path, writer: Writer, blocks: list[tuple[bytes, torch.Tensor]]) -> int:
    """Append blocks at writer.data_bytes (cutting off a torn tail first) and sync; record where each went."""
    mode = "r+b" if data.exists() else "wb"
    fd = os.open(data, os.O_RDWR | os.O_CREAT, 0o600)
    with os.fdopen(fd, mode) as fh:
        fh.truncate(writer.data_bytes)
        fh.seek(writer.data_bytes)
        offset, written = writer.data_bytes, 0
        for key, kv in blocks:
            raw = block_bytes(kv)
            fh.write(raw)
            writer.entries[key] = (offset, hashlib.sha256(raw).digest())
            offset += raw.nbytes
            written += raw.nbytes
        fh.flush()
        os.fsync(fh.fileno())
    writer.data_bytes = offset
    return written


def summary(path: Path, writer: Writer, n: int, index: dict, written: int, start: float, unchanged=False,
            compacted=False) -> dict:
    data = path.parent / writer.data_name
    return {"path": str(path), "blocks": n, "tokens": n * index["block_size"], "pins": len(index["pins"]),
            "bytes": path.stat().st_size + data.stat().st_size, "written_bytes": written, "unchanged": unchanged,
            "compacted": compacted, "ms": round(1000 * (time.perf_counter() - start), 1)}


def block_reader(f: CheckedFile, saved: dict, dtype: torch.dtype, shape: tuple):
    """Check the data file against the manifest (every block's sha256; a tail past data_bytes is dropped with a
    warning) and return row(j) -> block j's KV, read from the file when asked."""
    meta, path = f.meta, f.path
    data, covered, size = data_path(path, meta), int(meta["data_bytes"]), int(meta["block_bytes"])
    if not data.is_file():
        raise CacheFormatError(f"{path}: its data file {data.name} is missing; delete {path.name} (the next save "
                               "writes both anew)")
    length = data.stat().st_size
    if length < covered:
        raise CacheFormatError(f"{path}: its data file {data.name} holds {length} bytes, the manifest names "
                               f"{covered}: it was cut; {REMEDY_TEXT}")
    if length > covered:
        warnings.warn(PrefixCacheWarning(
            f"{path}: {length - covered} bytes at the end of {data.name} were written after the last completed save "
            "(an interrupted save) and are ignored; the next save cuts them off"), stacklevel=4)
    want = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    if size != want and saved["rows"]:
        raise CacheFormatError(f"{path}: its blocks are {size} bytes; this cache's blocks are {dtype} {list(shape)} "
                               f"= {want} bytes")
    fh = open(data, "rb")
    f.closers.append(fh.close)

    def raw(j: int) -> bytes:
        fh.seek(saved["offsets"][j])
        return fh.read(size)

    for j, (offset, digest) in enumerate(zip(saved["offsets"], saved["sha256"])):
        if not 0 <= offset <= covered - size or hashlib.sha256(raw(j)).digest() != digest:
            f.tampered(f": block {j} in {data.name} does not match its sha256")

    def row(j: int) -> torch.Tensor:
        return torch.frombuffer(bytearray(raw(j)), dtype=dtype).reshape(shape)

    return row


REMEDY_TEXT = "delete the file (and its .data file); the next save writes both anew"
