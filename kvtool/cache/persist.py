"""Save a PrefixCache to a file and load it back: cached prefixes survive a restart.

As llama.cpp's ``--prompt-cache`` and mlx-lm's ``cache_prompt`` do for one prompt, but for the whole prefix tree: a
server restarted with ``--cache-file`` answers its first request on a known system prompt + tools from the cache,
and ``kvtool generate --cache-file`` skips the prefill of a prompt it has seen. A .kvc file is a checked KV file
(kvtool.cache.kvfile: safetensors, sha256, setup). Saves write format version 2 (kvtool.cache.kvlog): the .kvc is a
manifest, the KV sits in an append-only data file beside it and each save adds only new blocks. Version 1 (still
read) held the KV itself:

    kv.<j>       [2, L, H, B, D]     block j's keys (post-RoPE, at its positions) then values, cache dtype
                                     (version 1 only; version 2: offsets [N] and sha256 [N, 32] into the data)
    tokens       [N, B]              each block's token ids
    parents      [N]                 the parent's row in this file, -1 for a root; parents come first
    recency      [N]                 rank by last use, 0 = least recent
    pin_tokens   [P]                 the token ids of every permanent pin, concatenated
    pin_lengths  [K]                 their lengths

Loading inserts the pinned prefixes first (pinned as they go in, so nothing loaded later evicts them), then every
chain root..leaf from the least to the most recently used: when the budget is smaller than the file, the index's own
eviction keeps the most recent chains. The block size may differ from the saving cache's (chains are re-cut). One
tensor per block keeps memory flat: saving a CPU cache copies no KV, and loading verifies the checksums and then
reads block by block, so neither holds the cache twice. Blocks detached by a reset but still held by a running
request are not saved; hit counts (the lfu policy's key) start again from zero.
"""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path

import torch

from kvtool.cache.kvfile import SETUP_FIELDS, CheckedFile, setup_mismatches, write_checked
from kvtool.cache.kvlog import VERSION, block_reader, data_path, save_incremental
from kvtool.errors import CacheFormatError, PrefixCacheWarning

FORMAT = "kvtool.prefix-cache"
FORMAT_VERSION = "1"
INDEX_TENSORS = ("tokens", "parents", "recency", "pin_tokens", "pin_lengths")  # and kv.<j> per block
KIND = "prefix cache (.kvc)"
REMEDY = "Delete it; the server or `kvtool generate --cache-file` writes a new one."
KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # what a file's blocks may hold


def snapshot(cache, setup: dict[str, str]) -> tuple[dict, list[torch.Tensor], dict]:
    """(index, KV per block, metadata) of what ``cache`` holds now, as both format versions store it."""
    blocks, pins, kv = cache.export_blocks()
    row = {block_id: j for j, (block_id, *_) in enumerate(blocks)}
    n, bs = len(blocks), cache.block_size
    recency = torch.empty(n, dtype=torch.int64)
    recency[sorted(range(n), key=lambda j: blocks[j][3])] = torch.arange(n)
    rows = [list(tokens) for _, _, tokens, _ in blocks]
    parents = [-1 if parent is None else row[parent] for _, parent, _, _ in blocks]
    tensors = {
        "tokens": torch.tensor(rows, dtype=torch.int64).reshape(n, bs),
        "parents": torch.tensor(parents, dtype=torch.int64),
        "recency": recency,
        "pin_tokens": torch.tensor([t for key in pins for t in key], dtype=torch.int64),
        "pin_lengths": torch.tensor([len(key) for key in pins], dtype=torch.int64),
    }
    store = cache.store
    meta = {**setup, "format": FORMAT, "format_version": FORMAT_VERSION, "block_size": bs, "n_blocks": n,
            "keys_layout": "post_rope", "kv_dtype": str(store.dtype).replace("torch.", ""),
            "kv_shape": json.dumps([2, store.num_layers, store.num_kv_heads, bs, store.head_dim])}
    index = {"tensors": tensors, "rows": rows, "parents": parents, "pins": [tuple(p) for p in pins],
             "block_size": bs}
    return index, kv, meta


def save_cache(cache, path: str | Path, setup: dict[str, str]) -> dict:
    """Save ``cache`` (a PrefixCache) to ``path`` incrementally (format version 2, kvtool.cache.kvlog): only the
    blocks the file lacks are written. Returns what was saved and written_bytes."""
    index, kv, meta = snapshot(cache, setup)
    return save_incremental(cache, path, index, kv, meta, read_manifest)


def block_name(j: int) -> str:
    return f"kv.{j:07d}"


def open_file(path: str | Path) -> CheckedFile:
    """The .kvc file (either version) at ``path``, verified when entered (``with open_file(path) as f``)."""
    return CheckedFile(path, KIND, FORMAT, (FORMAT_VERSION, VERSION), REMEDY)


def read_v2(f: CheckedFile) -> dict:
    """The index of a version-2 manifest (as read_index) plus each block's offset and sha256 in its data file."""
    saved = read_index(f, extra=("offsets", "sha256"))
    n = len(saved["rows"])
    offsets, digests = f.tensor("offsets"), f.tensor("sha256")
    if tuple(offsets.shape) != (n,) or tuple(digests.shape) != (n, 32):
        raise CacheFormatError(f"{f.path}: offsets and sha256 must have one entry per block ({n})")
    saved["offsets"] = offsets.tolist()
    saved["sha256"] = [bytes(row) for row in digests.tolist()]
    return saved


def read_manifest(path: Path) -> tuple[dict, dict] | None:
    """(metadata, index) of the version-2 manifest at ``path``; None for a version-1 file."""
    with open_file(path) as f:
        return (dict(f.meta), read_v2(f)) if f.meta["format_version"] == VERSION else None


def read_index(f: CheckedFile, extra: tuple[str, ...] = ()) -> dict:
    """What an open .kvc holds besides the KV: rows (token ids per block), parents, recency, pins, block_size.
    extra: the other tensors of a version-2 manifest (which holds no KV)."""
    path, t = f.path, {name: f.tensor(name) for name in INDEX_TENSORS}
    tokens, parents, recency = t["tokens"], t["parents"].tolist(), t["recency"]
    if tokens.dim() != 2 or tokens.shape[1] < 1:
        raise CacheFormatError(f"{path}: tokens must be [blocks, block_size], got {tuple(tokens.shape)}")
    n = tokens.shape[0]
    if f.names != set(INDEX_TENSORS) | (set(extra) if extra else {block_name(j) for j in range(n)}):
        f.tampered(": its KV tensors are not one per block" if not extra else ": its tensors are not a manifest's")
    if len(parents) != n or tuple(recency.shape) != (n,):
        raise CacheFormatError(f"{path}: parents and recency must have one entry per block ({n})")
    if any(not -1 <= p < j for j, p in enumerate(parents)):
        raise CacheFormatError(f"{path}: a block's parent is not an earlier block of the file")
    lengths, flat = t["pin_lengths"], t["pin_tokens"]
    if lengths.dim() != 1 or (lengths < 0).any() or int(lengths.sum()) != flat.numel():
        raise CacheFormatError(f"{path}: pin_lengths do not add up to the {flat.numel()} pinned tokens")
    pins, offset = [], 0
    for length in lengths.tolist():
        pins.append(flat[offset : offset + length].tolist())
        offset += length
    return {"meta": f.meta, "rows": tokens.tolist(), "parents": parents, "recency": recency.tolist(), "pins": pins,
            "block_size": tokens.shape[1]}


def chains(saved: dict) -> list[list[int]]:
    """Rows root..leaf of every saved chain, from the least to the most recently used leaf."""
    parents, recency = saved["parents"], saved["recency"]
    has_child, out = set(parents), []
    for leaf in sorted((j for j in range(len(parents)) if j not in has_child), key=recency.__getitem__):
        rows = [leaf]
        while parents[rows[-1]] != -1:
            rows.append(parents[rows[-1]])
        out.append(rows[::-1])
    return out


def describe_file(path: str | Path) -> dict:
    """What a .kvc file holds (no model needed): its setup, sizes, and the tree of its prefixes (kvtool.cache.tree,
    without hits: a file does not keep them)."""
    from kvtool.cache.index import PrefixIndex
    from kvtool.cache.tree import segments, walk

    size = Path(path).stat().st_size if Path(path).is_file() else 0
    with open_file(path) as f:
        saved = read_v2(f) if f.meta["format_version"] == VERSION else read_index(f)
        if f.meta["format_version"] == VERSION:
            data = data_path(f.path, f.meta)
            size += data.stat().st_size if data.is_file() else 0
    bs, n = saved["block_size"], len(saved["rows"])
    index = PrefixIndex(bs, max(n, 1))
    for rows in chains(saved):
        index.insert([t for j in rows for t in saved["rows"][j]])
    for key in saved["pins"]:
        index.pin_prefix(key)
    tree = segments(index.snapshot()[0], bs)
    for segment in walk(tree):
        del segment["hits"], segment["block_ids"], segment["in_use_tokens"]
    meta = saved["meta"]
    return {"path": str(path), "setup": {k: meta.get(k) for k in SETUP_FIELDS}, "dtype": meta.get("kv_dtype"),
            "block_size": bs, "blocks": n, "tokens": n * bs, "pins": len(saved["pins"]),
            "format_version": meta["format_version"], "bytes": size, "tree": tree}


def load_cache(cache, path: str | Path, setup: dict[str, str]) -> dict:
    """Add the prefixes saved in ``path`` to ``cache``; CacheFormatError for a bad file or another setup."""
    start = time.perf_counter()
    with open_file(path) as f:
        return _load(cache, f, setup, start)


def _load(cache, f: CheckedFile, setup: dict[str, str], start: float) -> dict:
    path, v2 = f.path, f.meta["format_version"] == VERSION
    saved = read_v2(f) if v2 else read_index(f)
    diffs = setup_mismatches(saved["meta"], setup, what="file")
    if diffs:
        raise CacheFormatError(f"{path}: this prefix cache was saved for a different setup: " + "; ".join(diffs)
                               + ". Its KV cannot be used with this model: delete the file or give another path.")
    rows, bs, store = saved["rows"], saved["block_size"], cache.store
    n, want = len(rows), (2, store.num_layers, store.num_kv_heads, saved["block_size"], store.head_dim)

    # KV in the file's dtype, converted to the cache's as read (bf16 widens exactly, fp32 rounds to nearest even)
    dtype = KV_DTYPES.get(saved["meta"].get("kv_dtype"), store.dtype) if v2 else store.dtype
    read = block_reader(f, saved, dtype, want) if v2 else (lambda j: f.tensor(block_name(j)))

    def row(j: int) -> torch.Tensor:  # block j's KV [2, L, H, B, D], read from the file now
        kv = read(j)
        if kv.dtype != store.dtype and kv.dtype in KV_DTYPES.values():
            kv = kv.to(store.dtype)
        if tuple(kv.shape) != want or kv.dtype != store.dtype:
            raise CacheFormatError(f"{path}: block {j} is {kv.dtype} {tuple(kv.shape)}; this cache holds "
                                   f"{store.dtype} [2, layers, kv_heads, block_size, head_dim] = {list(want)}")
        return kv

    by_key = {(p, tuple(rows[j])): j for j, p in enumerate(saved["parents"])}

    def chain(ids: list[int]) -> list[int]:  # rows of the saved blocks that spell ids, from a root
        out, parent = [], -1
        for i in range(len(ids) // bs):
            j = by_key.get((parent, tuple(ids[i * bs : (i + 1) * bs])))
            if j is None:
                break
            out.append(j)
            parent = j
        return out

    def block_kv(path_rows: list[int]):  # i -> (keys, values) [L, H, B', D] of block i in the loading cache
        if cache.block_size == bs:  # the saved blocks as they are, each read when it is needed
            return lambda i: tuple(row(path_rows[i]))
        joined, b = [], cache.block_size  # another block size: the chain's KV [2, L, H, T, D], read when first
        # asked for, then cut anew

        def cut(i):
            if not joined:
                joined.append(torch.cat([row(j) for j in path_rows], dim=3))
            return joined[0][0, :, :, i * b : (i + 1) * b], joined[0][1, :, :, i * b : (i + 1) * b]

        return cut

    def tokens_of(path_rows: list[int]) -> list[int]:
        return [token for j in path_rows for token in rows[j]]

    pins = saved["pins"]
    for key in pins:
        rows_ = chain(key)
        cache.import_chain(tokens_of(rows_), block_kv(rows_), pin=key)
    saved_chains = chains(saved)
    for rows_ in saved_chains:
        cache.import_chain(tokens_of(rows_), block_kv(rows_))
    # rows whose tokens are all cached now (asked in load order, so recency stays as loaded), and those that
    # could be: with another block size, a chain's last tokens short of a whole block are not
    loaded, whole = set(), set()
    for rows_ in saved_chains:
        loaded.update(rows_[: cache.cached_tokens(tokens_of(rows_)) // bs])
        whole.update(rows_[: len(rows_) * bs // cache.block_size * cache.block_size // bs])
    if len(loaded) < len(whole):
        warnings.warn(PrefixCacheWarning(
            f"{path}: the prefix cache budget holds {len(loaded) * bs} of the {len(whole) * bs} tokens of the prefixes "
            "saved there; the least recently used were left out (raise --cache-bytes to load them all)"), stacklevel=4)
    return {"path": str(path), "blocks": n, "tokens": n * bs, "loaded_tokens": len(loaded) * bs, "pins": len(pins),
            "ms": round(1000 * (time.perf_counter() - start), 1)}
