"""What kvtool's vLLM connector mounts, built from `kv_transfer_config` alone in each process vLLM puts a half in:
the settings (`kv_connector_extra_config`), the model's identity and RoPE (read from vLLM's model config; no
weights), the compiled skill blocks (.kvb files: the scheduler keeps their token ids, a worker reads a block's KV
when a request places it), and the block store's layout for a tensor-parallel rank's KV heads.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvtool.cache.blockrecord import Layout
from kvtool.config import EngineConfig
from kvtool.errors import InvalidParameterError
from kvtool.models.runner import ModelRunner
from kvtool.skills.match import BlockIndex

SETTINGS = {"blocks": "compiled skill blocks: a folder of .kvb files or a list of them (kvtool skill compile -o)",
            "kv_store": "the shared block store: a folder or redis://host:port/db",
            "kv_store_bytes": "the folder store's size limit in bytes",
            "kv_store_block": "tokens per store record (kvtool's prefix block, so kvtool's engine shares them)",
            "repair": "how blocks are placed; the connector computes nothing itself, so only 'none'",
            "skill_min_tokens": "blocks shorter than this are left to vLLM's prefill",
            "model_name": "the model's name in the store's layout (to share it with kvtool's own engine)",
            "load": "when supplied KV is written: 'sync' (before the step's forward), 'async' (by a loader thread "
                    "while vLLM's steps go on; the request waits in WAITING_FOR_REMOTE_KVS) or 'auto' (default: "
                    "sync when no other request is running, else async)"}

CLASS_NAME, MODULE = "KvtoolConnector", "kvtool.integrations.vllm.connector"  # what kv_transfer_config names


def transfer_config(extra: dict) -> dict:
    """The kv_transfer_config (as vLLM's EngineArgs and --kv-transfer-config take it) that mounts kvtool's connector
    with kv_connector_extra_config `extra` (SETTINGS); a block the store lost is recomputed by vLLM rather than
    failing its request. Built without importing vLLM, so a launcher in another environment can write it."""
    return {"kv_connector": CLASS_NAME, "kv_role": "kv_both", "kv_connector_module_path": MODULE,
            "kv_connector_extra_config": extra, "kv_load_failure_policy": "recompute"}


@dataclass(frozen=True)
class MountSettings:
    blocks: tuple[str, ...] = ()
    kv_store: str | None = None
    kv_store_bytes: int | None = None
    kv_store_block: int = EngineConfig.prefix_block
    repair: str = "none"
    skill_min_tokens: int = EngineConfig.skill_min_tokens
    model_name: str | None = None
    load: str = "auto"

    @classmethod
    def from_extra(cls, extra: dict | None) -> "MountSettings":
        """The settings in kv_connector_extra_config; InvalidParameterError naming what is wrong."""
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(SETTINGS))
        if unknown:
            raise InvalidParameterError(f"KvtoolConnector: unknown kv_connector_extra_config key(s) {unknown}; known: "
                                        + "; ".join(f"{k} ({v})" for k, v in SETTINGS.items()))
        repair = str(extra.get("repair", "none"))
        if repair != "none":
            raise InvalidParameterError(
                f"KvtoolConnector: repair {repair!r} recomputes block tokens against the prompt, and the connector "
                "computes nothing itself (vLLM's forward computes only what follows the supplied prefix); mount the "
                "blocks with repair 'none' (docs/skills.md measures its fidelity), or serve them on kvtool's own "
                "engine, which runs every repair")
        minimum = extra.get("skill_min_tokens", cls.skill_min_tokens)
        if not isinstance(minimum, int) or minimum < 0:
            raise InvalidParameterError(f"KvtoolConnector: skill_min_tokens must be a whole number >= 0, got "
                                        f"{minimum!r}")
        load = extra.get("load", cls.load)
        if load not in ("auto", "async", "sync"):
            raise InvalidParameterError(f"KvtoolConnector: load must be 'auto', 'async' or 'sync', got {load!r}")
        for key in ("kv_store_bytes", "kv_store_block"):
            value = extra.get(key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise InvalidParameterError(f"KvtoolConnector: {key} must be a positive whole number, got {value!r}")
        return cls(block_files(extra.get("blocks")), extra.get("kv_store") or None, extra.get("kv_store_bytes"),
                   extra.get("kv_store_block") or cls.kv_store_block, repair, minimum, extra.get("model_name"), load)


def block_files(blocks) -> tuple[str, ...]:
    """The .kvb files named by `blocks` (a folder, one file, or a list of files), sorted; checked to exist."""
    if blocks in (None, "", []):
        return ()
    items = [blocks] if isinstance(blocks, str) else blocks
    if not isinstance(items, (list, tuple)) or not all(isinstance(x, str) for x in items):
        raise InvalidParameterError(f"KvtoolConnector: blocks must be a folder or a list of .kvb files, got {blocks!r}")
    out = []
    for item in items:
        path = Path(item).expanduser()
        if path.is_dir():
            found = sorted(path.glob("*.kvb"))
            if not found:
                raise InvalidParameterError(
                    f"KvtoolConnector: {path} holds no compiled blocks (.kvb); compile its skills first: "
                    f"kvtool skill compile {path} --model MODEL -o BLOCKS_FOLDER")
            out += [str(p) for p in found]
        elif path.suffix == ".kvb" and path.is_file():
            out.append(str(path))
        else:
            raise InvalidParameterError(f"KvtoolConnector: blocks {item!r} is neither a folder nor a .kvb file")
    return tuple(out)


class RopeFrame:
    """The model's RoPE without its weights: what kvtool.cache.kvfile.rope_info and the re-rotation of a block's
    keys (kvtool.skills.repair.rerotate_layers) read from a runner."""

    def __init__(self, hf_config):
        from kvtool.models.spec import ModelSpec

        self.spec = ModelSpec.from_hf_config(hf_config)
        ModelRunner.set_rope(self, hf_config)  # the runner's own code, on this frame's spec

    def rope_groups(self) -> list[tuple[list[int], torch.Tensor]]:
        return ModelRunner.rope_groups(self)


def model_setup(model_config, rope: RopeFrame, name: str | None) -> dict[str, str]:
    """kvtool.cache.kvfile.setup_of for the model vLLM serves: name, config and tokenizer hashes, dtype, RoPE."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_config.tokenizer, trust_remote_code=False)
    return setup_for(tokenizer, str(model_config.dtype), name or Path(str(model_config.model)).name, rope)


def setup_for(tokenizer, dtype: str, name: str, rope: RopeFrame) -> dict[str, str]:
    """The setup fields (kvtool.cache.kvfile.SETUP_FIELDS) as kvtool's engine computes them for its model."""
    from kvtool.cache.kvfile import rope_info

    vocab = hashlib.sha256(json.dumps(tokenizer.get_vocab(), sort_keys=True).encode()).hexdigest()[:16]
    return {"model": name, "config_hash": rope.spec.config_hash(), "tokenizer_hash": vocab,
            "dtype": dtype.removeprefix("torch."), "rope": rope_info(rope)}


def rank_heads(num_kv_heads: int, tp_size: int, rank: int) -> tuple[int, int]:
    """The [start, stop) of the model's KV heads that tensor-parallel rank `rank` of `tp_size` holds: an equal share,
    or, with fewer heads than ranks, the one head it replicates (as vLLM splits them)."""
    if tp_size < 1 or not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} of a tensor-parallel size {tp_size}")
    if num_kv_heads >= tp_size:
        if num_kv_heads % tp_size:
            raise ValueError(f"{num_kv_heads} KV heads do not split over {tp_size} ranks")
        per = num_kv_heads // tp_size
        return rank * per, (rank + 1) * per
    head = rank * num_kv_heads // tp_size
    return head, head + 1


def store_layout(setup: dict, spec, dtype: torch.dtype, block_size: int, heads: tuple[int, int]) -> Layout:
    """The block store's layout for KV of `heads` (all of them: (0, num_kv_heads))."""
    whole = heads == (0, spec.num_kv_heads)
    return Layout(setup, spec.num_layers, spec.num_kv_heads, spec.head_dim, str(dtype).removeprefix("torch."),
                  block_size, (0, 0) if whole else heads)


@dataclass
class Shelf:
    """The mounted blocks: names, token ids and canonical starts (what the plan needs), the files to read KV from."""

    files: dict[str, str] = field(default_factory=dict)
    starts: dict[str, int] = field(default_factory=dict)
    lengths: dict[str, int] = field(default_factory=dict)
    index: BlockIndex = field(default_factory=BlockIndex)

    @classmethod
    def load(cls, files, rope: RopeFrame) -> "Shelf":
        """Each block checked (its checksum, and that it was compiled for this model's config and RoPE)."""
        shelf = cls()
        for path in files:
            block = _read(path, rope)
            if block.name in shelf.files:
                raise InvalidParameterError(f"KvtoolConnector: two blocks are named {block.name!r} "
                                            f"({shelf.files[block.name]}, {path})")
            shelf.files[block.name], shelf.starts[block.name] = path, block.canonical_start
            shelf.lengths[block.name] = len(block)
            shelf.index.add(block.name, block.token_ids)
        return shelf

    def kv(self, name: str, rope: RopeFrame, heads: tuple[int, int], first: int, last: int, at: int, dtype):
        """(keys, values) [L, heads, last - first, D] of block tokens [first, last), keys re-rotated from the block's
        canonical positions to the block starting at prompt position `at`, in `dtype`."""
        from safetensors import safe_open

        from kvtool.skills.repair import rerotate_layers

        # the file was checked whole when mounted (Shelf.load): here only the window placed is read
        with safe_open(self.files[name], framework="pt") as f:
            keys = f.get_slice("keys")[:, heads[0]:heads[1], first:last].float()
            values = f.get_slice("values")[:, heads[0]:heads[1], first:last]
        keys = rerotate_layers(rope, keys.contiguous(), at - self.starts[name])
        return keys.to(dtype), values.to(dtype)

    def summary(self) -> list[dict]:
        return [{"name": n, "tokens": self.lengths[n], "file": self.files[n]} for n in sorted(self.files)]


def _read(path: str, rope: RopeFrame):
    from kvtool.cache.kvfile import rope_info
    from kvtool.skills.block import load_block

    block = load_block(path)
    spec = rope.spec
    want = (spec.num_layers, spec.num_kv_heads, spec.head_dim)
    have = (block.keys.shape[0], block.keys.shape[1], block.keys.shape[3])
    if block.setup.get("config_hash") != spec.config_hash() or have != want:
        raise InvalidParameterError(f"KvtoolConnector: block {block.name!r} ({path}) was compiled for another model "
                                    f"(KV layers, heads, head_dim {list(have)}; this one {list(want)}); recompile it "
                                    "with kvtool skill compile for the model vLLM serves")
    if block.setup.get("rope") != rope_info(rope):
        raise InvalidParameterError(f"KvtoolConnector: block {block.name!r} ({path}) was compiled with another RoPE "
                                    f"setting ({block.setup.get('rope')}); recompile it")
    return block
