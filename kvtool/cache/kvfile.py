"""Checked KV files: safetensors (never pickle) plus the setup the KV was computed under.

Skill blocks (.kvb, kvtool.skills.block) and saved prefix caches (.kvc, kvtool.cache.persist) are written and read
here. A file holds named tensors and string metadata; the metadata carries a sha256 over itself and every tensor's
dtype, shape and bytes, verified on load, so a truncated, damaged or edited file is refused instead of feeding wrong
KV to a model. KV is only valid for the setup it came from: SETUP_FIELDS (model, config hash, tokenizer hash, dtype,
RoPE) are stored in the metadata and compared one by one, each mismatch named.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import weakref
from pathlib import Path

import torch

from kvtool.errors import CacheFormatError

# Fields KV must match to be used with a model (the "setup"); compared one by one on load.
SETUP_FIELDS = ("model", "config_hash", "tokenizer_hash", "dtype", "rope")
SETUP_LABELS = {"model": "model", "config_hash": "model config", "tokenizer_hash": "tokenizer", "dtype": "dtype",
                "rope": "RoPE setting"}

_ROPE_INFO: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # runner -> rope_info (no host sync per use)


def rope_info(runner) -> str:
    """The RoPE setting as canonical JSON: rope parameters, attention scaling, inv_freq bytes."""
    if runner not in _ROPE_INFO:
        freq = runner.inv_freq.detach().float().cpu().contiguous()
        info = {"rope": runner.spec.rope, "attention_scaling": float(runner.rope_scaling),
                "head_dim": runner.spec.head_dim,
                "inv_freq_sha256": hashlib.sha256(freq.numpy().tobytes()).hexdigest()[:16]}
        if runner.spec.rope_local:  # a second base for sliding-window layers (Gemma 3)
            info["rope_local"] = runner.spec.rope_local
        _ROPE_INFO[runner] = json.dumps(info, sort_keys=True, default=str)
    return _ROPE_INFO[runner]


def setup_of(model=None, runner=None, name: str | None = None) -> dict[str, str]:
    """What stored KV must match: a LoadedModel's fingerprint plus RoPE; or a bare runner's (no tokenizer)."""
    runner = runner if runner is not None else model.runner
    if model is not None:
        fp = model.fingerprint()
    else:
        fp = {"model": name or "unnamed", "config_hash": runner.spec.config_hash(), "tokenizer_hash": "none",
              "dtype": runner.precision}
    return {**{k: str(v) for k, v in fp.items()}, "rope": rope_info(runner)}


def setup_mismatches(have: dict[str, str], expected: dict[str, str], what: str = "block") -> list[str]:
    """One line per setup field that differs: '<label>: <what> has X, this model has Y'."""
    return [f"{SETUP_LABELS[k]}: {what} has {have.get(k)!r}, this model has {expected.get(k)!r}"
            for k in SETUP_FIELDS if have.get(k) != expected.get(k)]


def digest(meta: dict[str, str], tensors: dict[str, torch.Tensor]) -> str:
    return _hash(meta, tensors, tensors.__getitem__)


def _hash(meta: dict[str, str], names, get) -> str:
    """sha256 over the metadata and each tensor's name, dtype, shape and bytes, by name; get(name) -> tensor,
    asked one at a time, so a reader need not hold them all."""
    h = hashlib.sha256(json.dumps(meta, sort_keys=True).encode())
    for name in sorted(names):
        t = get(name).detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{list(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())  # the buffer itself, not a copy
    return h.hexdigest()


def write_checked(path: str | Path, tensors: dict[str, torch.Tensor], meta: dict[str, str],
                  sync: bool = False) -> Path:
    """Write tensors (moved to CPU) and meta plus its sha256, atomically: a temp file of this writer's own, then a
    rename, so concurrent writers of one path each leave a whole file (the last one wins). The file is the
    owner's only (mode 0600, as mkstemp makes it): a cache holds the token ids of every prompt in it. sync: the
    temp file reaches the disk before the rename (a power cut then leaves the old file or the new one)."""
    from safetensors.torch import save_file

    path = Path(path)
    tensors = {name: t.detach().cpu().contiguous() for name, t in tensors.items()}
    meta = {k: str(v) for k, v in meta.items()}
    meta["sha256"] = digest(meta, tensors)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")  # one per writer
    os.close(handle)
    tmp = Path(name)
    try:
        save_file(tensors, str(tmp), metadata=meta)
        if sync:
            with open(tmp, "rb") as fh:
                os.fsync(fh.fileno())
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


class CheckedFile:
    """A file written by write_checked, opened and verified (its sha256, one tensor at a time, so nothing but
    the tensor being hashed is held, unless ``keep``: then each is read once and kept); then ``tensor(name)``
    reads tensors one by one. A context manager.

    kind: what the file is, for messages ('skill block (.kvb)'); fmt/version: the expected `format` and
    `format_version` (or a tuple of the versions read); remedy: what to do about a bad file. Every problem is a CacheFormatError naming the path."""

    def __init__(self, path: str | Path, kind: str, fmt: str, version: str | tuple[str, ...], remedy: str,
                 keep: bool = False):
        self.path, self.kind, self.short = Path(path), kind, kind.split(" (")[0]
        self.fmt, self.remedy = fmt, remedy
        self.versions = (version,) if isinstance(version, str) else tuple(version)
        self.closers: list = []  # run on exit (e.g. a data file opened beside this one)
        self.meta: dict[str, str] = {}
        self.names: set[str] = set()
        self._kept: dict[str, torch.Tensor] | None = {} if keep else None  # keep: a small file, read once
        self._fh = None

    def _read(self, name: str) -> torch.Tensor:
        if self._kept is None:
            return self._fh.get_tensor(name)
        if name not in self._kept:
            self._kept[name] = self._fh.get_tensor(name)
        return self._kept[name]

    def __enter__(self) -> "CheckedFile":
        from safetensors import safe_open

        path, short = self.path, self.short
        if not path.is_file():
            raise CacheFormatError(f"{path}: is a folder, not a {self.kind} file" if path.is_dir() else
                                   f"{path}: no such {short} file")
        try:
            self._fh = safe_open(str(path), framework="pt", device="cpu").__enter__()
            meta, self.names = dict(self._fh.metadata() or {}), set(self._fh.keys())
            if meta.get("format") == self.fmt and meta.get("format_version") in self.versions:
                stored = meta.pop("sha256", None)
                intact = stored == _hash(meta, self.names, self._read)
        except Exception as exc:  # safetensors raises its own error types for truncated/garbled files
            self.__exit__(None, None, None)
            raise CacheFormatError(f"{path}: not a readable {short} (truncated, corrupted or not safetensors): "
                                   f"{exc}") from None
        try:
            if meta.get("format") != self.fmt:
                raise CacheFormatError(f"{path}: not a kvtool {short} (format {meta.get('format')!r})")
            if meta.get("format_version") not in self.versions:
                raise CacheFormatError(f"{path}: {short} format version {meta.get('format_version')!r}; this "
                                       f"kvtool reads version {' or '.join(self.versions)}. {self.remedy}")
            if not intact:
                self.tampered()
        except CacheFormatError:
            self.__exit__(None, None, None)
            raise
        self.meta = meta
        return self

    def tampered(self, why: str = "") -> None:
        """Raise the checksum error (also for a verified file whose tensors are not what its format holds)."""
        raise CacheFormatError(f"{self.path}: checksum mismatch: the file was modified after it was written "
                               f"(tampered or damaged{why}); {self.remedy[0].lower() + self.remedy[1:]}")

    def tensor(self, name: str) -> torch.Tensor:
        if name not in self.names:
            self.tampered(f": it holds no tensor {name!r}")
        return self._read(name)

    def __exit__(self, *exc) -> None:
        while self.closers:
            self.closers.pop()()
        if self._fh is not None:
            self._fh.__exit__(None, None, None)
            self._fh = None


def read_checked(path: str | Path, kind: str, fmt: str, version: str, names: set[str],
                 remedy: str) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """(meta without sha256, tensors) of a small file written by write_checked that holds exactly ``names``
    (see CheckedFile for the other arguments and the errors)."""
    with CheckedFile(path, kind, fmt, version, remedy, keep=True) as f:  # each tensor read once: hashed and kept
        if f.names != names:
            f.tampered()
        return f.meta, {name: f.tensor(name) for name in names}
