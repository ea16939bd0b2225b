"""Checked KV files: safetensors (never pickle) plus the setup the KV was computed under.

Skill blocks (.kvb, kvtool.skills.block) and saved prefix caches (.kvc, kvtool.cache.persist) are
written and read here. A file holds named tensors and string metadata; the metadata carries a
sha256 over itself and every tensor's dtype, shape and bytes, verified on load, so a truncated,
damaged or edited file is refused instead of feeding wrong KV to a model. KV is only valid for the
setup it came from: SETUP_FIELDS (model, config hash, tokenizer hash, dtype, RoPE) are stored in
the metadata and compared one by one, each mismatch named.
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
        _ROPE_INFO[runner] = json.dumps({"rope": runner.spec.rope, "attention_scaling": float(runner.rope_scaling),
                                         "head_dim": runner.spec.head_dim,
                                         "inv_freq_sha256": hashlib.sha256(freq.numpy().tobytes()).hexdigest()[:16]},
                                        sort_keys=True, default=str)
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
    h = hashlib.sha256(json.dumps(meta, sort_keys=True).encode())
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{list(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())  # the buffer itself, not a copy
    return h.hexdigest()


def write_checked(path: str | Path, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> Path:
    """Write tensors (moved to CPU) and meta plus its sha256, atomically: a temp file of this writer's own, then a
    rename, so concurrent writers of one path each leave a whole file (the last one wins). The file is the
    owner's only (mode 0600, as mkstemp makes it): a cache holds the token ids of every prompt in it."""
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
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def read_checked(path: str | Path, kind: str, fmt: str, version: str, names: set[str],
                 remedy: str) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """(meta without sha256, tensors) of a file written by write_checked, or CacheFormatError naming the path.

    kind: what the file is, for messages ('skill block (.kvb)'); fmt/version: the expected `format` and
    `format_version`; names: the tensor names it must hold; remedy: what to do about a bad file."""
    from safetensors import safe_open

    path = Path(path)
    short = kind.split(" (")[0]
    if not path.is_file():
        raise CacheFormatError(f"{path}: is a folder, not a {kind} file" if path.is_dir() else
                               f"{path}: no such {short} file")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as fh:
            meta = dict(fh.metadata() or {})
            tensors = {name: fh.get_tensor(name) for name in fh.keys()}
    except Exception as exc:  # safetensors raises its own error types for truncated/garbled files
        raise CacheFormatError(f"{path}: not a readable {short} (truncated, corrupted or not safetensors): "
                               f"{exc}") from None
    if meta.get("format") != fmt:
        raise CacheFormatError(f"{path}: not a kvtool {short} (format {meta.get('format')!r})")
    if meta.get("format_version") != version:
        raise CacheFormatError(f"{path}: {short} format version {meta.get('format_version')!r}; this kvtool "
                               f"reads version {version}. {remedy}")
    stored = meta.pop("sha256", None)
    if set(tensors) != names or stored != digest(meta, tensors):
        raise CacheFormatError(f"{path}: checksum mismatch: the file was modified after it was written "
                               f"(tampered or damaged); {remedy[0].lower() + remedy[1:]}")
    return meta, tensors
