"""The content address and the bytes of one KV block in a shared block store (kvtool.cache.kvstore).

A block's key is a chain hash: blake2b(parent's key + the block's token ids as int64), rooted in the hash of its
Layout (the model's identity and the KV's shape, dtype, block size and the KV heads held), so two engines that
computed the same tokens of the same model in the same layout name the block alike, and nothing else does.

A record is one block, whole or not at all to a reader:

    b"KVTB" | version u16 | header length u32 | payload length u64 | header (JSON) | payload | blake2b-256 of all before

The header holds the key, the parent's key, the block's token ids and the Layout; the payload is the block's
KV [2, L, H, B, D] (keys post-RoPE, then values) in the layout's dtype. decode() answers None for anything else
(torn, foreign, another version or key), so a reader treats a bad record as a miss. Pure Python.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass, field
from typing import Sequence

MAGIC = b"KVTB"
VERSION = 1
_FRAME = struct.Struct("<4sHIQ")  # magic, version, header length, payload length
_DIGEST = 32


@dataclass(frozen=True)
class Layout:
    """What a block's KV is valid for. setup: the model's identity (kvtool.cache.kvfile.setup_of); heads: the
    [start, stop) of the model's num_kv_heads that the blocks hold (a tensor-parallel rank's share)."""

    setup: dict = field(hash=False)
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name without "torch.", e.g. "float32"
    block_size: int
    heads: tuple[int, int] = (0, 0)  # (0, 0): all of num_kv_heads

    def describe(self) -> dict:
        start, stop = self.heads if self.heads != (0, 0) else (0, self.num_kv_heads)
        return {"setup": {k: str(v) for k, v in sorted(self.setup.items())}, "num_layers": self.num_layers,
                "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim, "dtype": self.dtype,
                "block_size": self.block_size, "heads": [start, stop]}

    @classmethod
    def from_dict(cls, d: dict) -> "Layout":
        """The Layout that describe() gave ``d``."""
        return cls(d["setup"], d["num_layers"], d["num_kv_heads"], d["head_dim"], d["dtype"], d["block_size"],
                   tuple(d["heads"]))

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        start, stop = self.describe()["heads"]
        return 2, self.num_layers, stop - start, self.block_size, self.head_dim

    @property
    def root(self) -> bytes:
        return hashlib.blake2b(json.dumps(self.describe(), sort_keys=True).encode(), digest_size=16).digest()

    def keys(self, tokens: Sequence[int], stop: int | None = None) -> list[str]:
        """The keys of the first ``stop`` full blocks of ``tokens`` (all of them by default), root first, as hex."""
        bs, parent, out = self.block_size, self.root, []
        for i in range(len(tokens) // bs if stop is None else stop):
            parent = chain_key(parent, tokens[i * bs : (i + 1) * bs])
            out.append(parent.hex())
        return out

    def tail_key(self, tokens: Sequence[int]) -> str | None:
        """The key of the partial block that ends ``tokens`` (after its whole blocks), as hex; None if none. Its
        record's payload is a whole block's, the positions past the tail zero."""
        whole = len(tokens) // self.block_size * self.block_size
        if whole == len(tokens):
            return None
        keys = self.keys(tokens)
        return chain_key(bytes.fromhex(keys[-1]) if keys else self.root, tokens[whole:]).hex()


def chain_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    return hashlib.blake2b(parent + struct.pack(f"<{len(tokens)}q", *tokens), digest_size=16).digest()


def encode(layout: Layout, key: str, parent: str | None, tokens: Sequence[int], payload) -> bytes:
    """The record of one block; payload: its KV's bytes (a bytes-like object of the layout's shape and dtype)."""
    header = json.dumps({"key": key, "parent": parent, "tokens": list(tokens), "layout": layout.describe()},
                        sort_keys=True).encode()
    payload = memoryview(payload).cast("B")
    body = _FRAME.pack(MAGIC, VERSION, len(header), payload.nbytes) + header
    digest = hashlib.blake2b(body, digest_size=_DIGEST)
    digest.update(payload)
    return b"".join((body, payload, digest.digest()))


def decode(record: bytes | None, key: str | None = None) -> tuple[dict, memoryview] | None:
    """(header, payload) of a whole, checked record (of ``key``, if given); None for anything else."""
    if record is None or len(record) < _FRAME.size + _DIGEST:
        return None
    magic, version, n_header, n_payload = _FRAME.unpack_from(record)
    if magic != MAGIC or version != VERSION or len(record) != _FRAME.size + n_header + n_payload + _DIGEST:
        return None
    view = memoryview(record)
    if hashlib.blake2b(view[:-_DIGEST], digest_size=_DIGEST).digest() != view[-_DIGEST:]:
        return None
    try:
        header = json.loads(bytes(view[_FRAME.size : _FRAME.size + n_header]))
    except ValueError:
        return None
    if not isinstance(header, dict) or (key is not None and header.get("key") != key):
        return None
    return header, view[_FRAME.size + n_header : -_DIGEST]
