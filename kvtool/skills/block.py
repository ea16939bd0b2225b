"""SkillBlock: one skill's prefilled KV, its token ids and where it was computed; .kvb files.

Keys are stored POST-RoPE at the canonical positions [canonical_start, canonical_start + T),
exactly as the KV cache holds them; placing the block at position s rotates them by
s - canonical_start. A .kvb file is safetensors (never pickle): tensors `keys`, `values`
[L, H, T, D] and `token_ids` [T]; string metadata (see META_FIELDS) with a sha256 over the
metadata and the tensor bytes, verified on load.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvtool.cache.kvfile import SETUP_FIELDS, read_checked, rope_info, setup_mismatches, setup_of, write_checked
from kvtool.errors import CacheFormatError

FORMAT = "kvtool.skill-block"
FORMAT_VERSION = "1"
__all__ = ["FORMAT", "FORMAT_VERSION", "SETUP_FIELDS", "SkillBlock", "compile_ids", "load_block", "rope_info",
           "save_block", "setup_of"]


@dataclass
class SkillBlock:
    name: str
    token_ids: list[int]
    keys: torch.Tensor  # [L, H, T, D] post-RoPE at canonical positions
    values: torch.Tensor  # [L, H, T, D]
    canonical_start: int
    setup: dict[str, str]  # SETUP_FIELDS
    meta: dict[str, str] = field(default_factory=dict)  # description, text, text_sha256, render, ...
    placed: dict = field(default_factory=dict, repr=False, compare=False)  # its relocated KV per position (repair)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def to(self, device) -> "SkillBlock":
        if self.keys.device == torch.device(device):
            return self
        return SkillBlock(self.name, self.token_ids, self.keys.to(device), self.values.to(device),
                          self.canonical_start, self.setup, self.meta)

    def check_setup(self, expected: dict[str, str], source: str = "") -> None:
        """Refuse a block made for another model, tokenizer, dtype or RoPE setting, naming each mismatch."""
        diffs = setup_mismatches(self.setup, expected)
        if diffs:
            where = f" ({source})" if source else ""
            raise CacheFormatError(f"skill block {self.name!r}{where} was compiled for a different setup: "
                                   + "; ".join(diffs) + ". Recompile it for this model with `kvtool skill compile`.")

    def check_runner(self, runner) -> None:
        """Structural check against a runner (layers, heads, head_dim, dtype, RoPE)."""
        spec = runner.spec
        want = (spec.num_layers, spec.num_kv_heads, len(self), spec.head_dim)
        if tuple(self.keys.shape) != want or self.values.shape != self.keys.shape:
            raise CacheFormatError(f"skill block {self.name!r} has KV {tuple(self.keys.shape)}; this model needs "
                                   f"[layers, kv_heads, tokens, head_dim] = {list(want)}")
        if self.keys.dtype != runner.dtype:
            raise CacheFormatError(f"skill block {self.name!r} is {self.keys.dtype}, the model runs in {runner.dtype}; "
                                   "recompile it for this dtype")
        if self.setup.get("rope") != rope_info(runner):
            raise CacheFormatError(f"skill block {self.name!r} was compiled with RoPE {self.setup.get('rope')}, "
                                   f"the model uses {rope_info(runner)}; recompile it")


@torch.inference_mode()
def compile_ids(runner, ids: list[int], setup: dict[str, str], name: str, preamble: list[int] = (),
                meta: dict[str, str] | None = None, chunk: int = 512, warm=None) -> SkillBlock:
    """Prefill preamble + ids and keep the KV of ids (canonical start = len(preamble)). `warm`: a cache
    holding the KV of the preamble's first warm.offset tokens, cloned instead of prefilled again."""
    if not ids:
        raise ValueError(f"skill {name!r} renders to no tokens")
    preamble, total = list(preamble), len(preamble) + len(ids)
    if warm is not None and warm.offset > len(preamble):
        raise ValueError(f"warm cache holds {warm.offset} tokens, more than the {len(preamble)}-token preamble")
    cache = warm.clone() if warm is not None else runner.new_cache(total + 1)
    cache.reserve(total + 1)
    runner.prefill((preamble + list(ids))[cache.offset:], cache, chunk=chunk, logits="none")
    keys, values = cache.stacked(len(preamble), len(preamble) + len(ids))
    return SkillBlock(name, [int(t) for t in ids], keys.contiguous(), values.contiguous(), len(preamble),
                      dict(setup), dict(meta or {}))


def save_block(block: SkillBlock, path: str | Path) -> Path:
    tensors = {"keys": block.keys, "values": block.values, "token_ids": torch.tensor(block.token_ids, dtype=torch.int64)}
    meta = {**block.meta, **block.setup, "format": FORMAT, "format_version": FORMAT_VERSION, "name": block.name,
            "keys_layout": "post_rope", "canonical_start": block.canonical_start, "n_tokens": len(block)}
    return write_checked(path, tensors, meta)


def load_block(path: str | Path, device="cpu", expected_setup: dict[str, str] | None = None) -> SkillBlock:
    """Read and verify a .kvb file; with expected_setup, also refuse a block made for another setup."""
    meta, tensors = read_checked(path, "skill block (.kvb)", FORMAT, FORMAT_VERSION, {"keys", "values", "token_ids"},
                                 "Recompile with `kvtool skill compile`.")
    keys, values, ids = tensors["keys"], tensors["values"], tensors["token_ids"]
    n = int(meta["n_tokens"])
    if keys.dim() != 4 or keys.shape != values.shape or keys.shape[2] != n or ids.shape != (n,):
        raise CacheFormatError(f"{path}: inconsistent shapes keys {tuple(keys.shape)}, values "
                               f"{tuple(values.shape)}, token_ids {tuple(ids.shape)} for {n} tokens")
    setup = {k: meta.pop(k) for k in SETUP_FIELDS if k in meta}
    for k in ("format", "format_version", "keys_layout", "n_tokens"):
        meta.pop(k, None)
    block = SkillBlock(meta.pop("name"), ids.tolist(), keys.to(device), values.to(device),
                       int(meta.pop("canonical_start")), setup, meta)
    if expected_setup is not None:
        block.check_setup(expected_setup, str(path))
    return block
