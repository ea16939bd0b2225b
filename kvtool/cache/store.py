"""KV blocks: the pool they come from, and the store of prefix-cache blocks, addressed by the ids PrefixIndex hands out.

A BlockPool is a model's one allocation of blocks [2, L, H, B, D] (keys, then values), which an Engine sizes from
its memory budget (memory_split) and shares between its requests' paged caches and its prefix cache: the one count
of its KV memory. The index decides which blocks exist; the store holds their tensors, each written once by put()
(or by the request whose block adopt() keeps) and immutable afterwards, so any number of requests share it.
"""

from __future__ import annotations

import math
import weakref
from typing import Iterable, Sequence

import torch

from kvtool.errors import InvalidParameterError, PoolExhausted

# keys/values for one block: a tensor [L, H, B, D] or a sequence of L tensors [H, B, D]
BlockKV = torch.Tensor | Sequence[torch.Tensor]

DEFAULT_BUDGET_FRACTION = 0.5  # of available RAM (CPU, MPS) or free GPU memory (CUDA): all of an engine's KV
DEFAULT_BUDGET_CAP = 32 << 30


def available_memory(device: torch.device | str = "cpu") -> int:
    """Bytes a new allocation could get: free GPU memory on CUDA, available RAM otherwise (psutil, which accelerate
    depends on)."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    import psutil

    return int(psutil.virtual_memory().available)


def memory_split(kv_bytes: int | None, cache_bytes: int | None, device: torch.device | str = "cpu") -> tuple[int, int]:
    """The one split of an engine's KV memory budget (half the memory available on the device, at most 32 GiB, read
    once): (running requests' bytes, prefix-cache bytes). A size given (EngineConfig.kv_bytes, cache_bytes) is kept;
    a missing one is half the budget."""
    total = 0 if kv_bytes is not None and cache_bytes is not None else int(
        min(DEFAULT_BUDGET_FRACTION * available_memory(device), DEFAULT_BUDGET_CAP))
    return (total // 2 if kv_bytes is None else kv_bytes), (total - total // 2 if cache_bytes is None else cache_bytes)


def kv_dtype(config, runner, paged: bool) -> torch.dtype:
    """An EngineConfig's (checked) kv_dtype as the dtype of an engine's blocks: another than the model's needs the C++
    CPU ops' steps (`paged`), which read fp32 or bf16, and no skills_dir (skill repair attends in the model's dtype);
    auto is then bfloat16 for bf16 weights, else the model's."""
    setting, skills = config.kv_dtype, config.skills_dir is not None
    auto = torch.bfloat16 if paged and not skills and runner.weights == "bf16" else runner.dtype
    dtype = auto if setting == "auto" else getattr(torch, setting)
    if dtype != runner.dtype and (skills or not paged):
        why = "skill blocks (skills_dir) are repaired in the model's dtype" if skills else "this engine runs the " \
            "reference forward, not the C++ CPU ops (forward auto or cpu-ops, an fp32 CPU model whose ops built)"
        raise InvalidParameterError(f"kv_dtype={setting!r}: KV in another dtype than the model's "
                                    f"({str(runner.dtype)[6:]}) cannot be used here: {why}; use kv_dtype='auto'")
    return dtype


class BlockPool:
    """KV blocks [2, L, H, B, D] of one model, all from one allocation of `nbytes` made at the first take(). A sized
    pool never hands out memory beyond it: with no slot spare, take() has `reclaim` (its prefix cache's eviction of
    a block no request holds) free some first, then raises PoolExhausted. An unsized pool (nbytes 0: a standalone
    cache's) makes each block an allocation of its own. A slot goes back to the pool when the last reference to its
    block tensor goes: a request's paged KVCache's, the store's, a saver's."""

    def __init__(self, block_shape: Sequence[int], dtype: torch.dtype, device: torch.device | str, nbytes: int = 0):
        names = ("keys and values", "num_layers", "num_kv_heads", "block_size", "head_dim")
        if bad := [f"{name}={n!r}" for name, n in zip(names, block_shape) if not isinstance(n, int) or n < 1]:
            raise ValueError(f"BlockPool: a block's sizes must be positive ints, got {', '.join(bad)}")
        self.block_shape, self.dtype = tuple(block_shape), dtype
        self.device = torch.empty(0, device=device).device  # resolves "cuda" to "cuda:0"
        self.blocks = nbytes // self.bytes_per_block
        self._pool: torch.Tensor | None = None
        self.spare = list(range(self.blocks - 1, -1, -1))  # pool slots that no block tensor refers to
        self.reclaim: weakref.WeakMethod | None = None  # frees a block, False when none can go (PrefixCache's)

    @classmethod
    def for_runner(cls, runner, block_size: int, nbytes: int = 0, dtype: torch.dtype | None = None) -> "BlockPool":
        s = runner.spec  # (dtype: kv_dtype()'s, else the model's)
        return cls((2, s.num_layers, s.num_kv_heads, block_size, s.head_dim), dtype or runner.dtype, runner.device,
                   nbytes)

    @property
    def bytes_per_block(self) -> int:
        return math.prod(self.block_shape) * self.dtype.itemsize

    def take(self) -> torch.Tensor:
        """A block [2, L, H, B, D] to write: a slot (PoolExhausted where none is spare, even after `reclaim`), or in an
        unsized pool an allocation of its own. Views of it must not outlive the tensor (its slot is taken again)."""
        with torch.inference_mode(False):  # taken inside a forward, it stays writable outside one
            if not self.blocks:
                return torch.empty(self.block_shape, dtype=self.dtype, device=self.device)
            try:
                self._pool = self._pool if self._pool is not None else torch.empty(
                    self.blocks, *self.block_shape, dtype=self.dtype, device=self.device)
            except (RuntimeError, MemoryError) as exc:  # e.g. under a strict overcommit policy
                raise PoolExhausted(f"the KV pool of {self.blocks * self.bytes_per_block:,} bytes could not be "
                                    f"allocated ({exc}); lower the engine's kv_bytes / cache_bytes") from None
            while not self.spare:  # its prefix cache evicts a block no request holds, where it has one
                if (reclaim := self.reclaim and self.reclaim()) is None or not reclaim():
                    raise PoolExhausted(f"the KV pool's {self.blocks} blocks ({self.blocks * self.block_shape[3]} "
                                        "tokens) are all in use; raise the engine's kv_bytes / cache_bytes "
                                        "(--kv-bytes, --cache-bytes)")
            slot = self.spare.pop()
            block = self._pool[slot]
        weakref.finalize(block, self.spare.append, slot)
        return block


class BlockStore:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                 dtype: torch.dtype = torch.float16, device: torch.device | str = "cpu", pool: BlockPool | None = None):
        self.block_shape = (2, num_layers, num_kv_heads, block_size, head_dim)
        self.pool = pool = pool or BlockPool(self.block_shape, dtype, device)  # (which checks the sizes)
        if (pool.block_shape, pool.dtype) != (self.block_shape, dtype):
            raise ValueError(f"BlockStore: its pool's blocks are {pool.dtype} {list(pool.block_shape)}, not {dtype} "
                             f"{list(self.block_shape)}")
        _, self.num_layers, self.num_kv_heads, self.block_size, self.head_dim = self.block_shape
        self.dtype, self.device, self.take, self.bytes_per_block = pool.dtype, pool.device, pool.take, pool.bytes_per_block
        self._blocks: dict[int, torch.Tensor] = {}  # id -> [2, L, H, B, D]

    @property
    def nbytes(self) -> int:
        return len(self._blocks) * self.bytes_per_block

    def ids(self) -> set[int]:
        return set(self._blocks)

    def put(self, block_id: int, keys: BlockKV, values: BlockKV) -> None:
        """Store one block's KV (cast to the store's dtype/device). Ids are write-once."""
        block = self.take()
        for i, (name, kv) in enumerate([("keys", keys), ("values", values)]):
            if isinstance(kv, torch.Tensor) and tuple(kv.shape) == self.block_shape[1:]:
                block[i].copy_(kv)  # one copy instead of one per layer (a commit puts many blocks)
                continue
            per_layer = [kv[layer] for layer in range(kv.shape[0])] if isinstance(kv, torch.Tensor) else list(kv)
            if len(per_layer) != self.num_layers or any(t.shape != self.block_shape[2:] for t in per_layer):
                got = [tuple(t.shape) for t in per_layer]
                raise ValueError(f"BlockStore.put: {name} for block {block_id} must be {self.num_layers} layers of "
                                 f"[H={self.num_kv_heads}, B={self.block_size}, D={self.head_dim}], got {got}")
            for layer, t in enumerate(per_layer):
                block[i, layer].copy_(t)
        self.adopt(block_id, block)

    def adopt(self, block_id: int, block: torch.Tensor) -> None:
        """Store a block [2, L, H, B, D] by reference, without a copy: its writer (a paged KVCache, whose full
        blocks these are) never writes it again."""
        if block_id in self._blocks:
            raise ValueError(f"BlockStore: block {block_id} is already stored; free it first")
        if tuple(block.shape) != self.block_shape or (block.dtype, block.device) != (self.dtype, self.device):
            raise ValueError(f"BlockStore.adopt: block {block_id} must be {self.dtype} {list(self.block_shape)} on "
                             f"{self.device}, got {block.dtype} {list(block.shape)} on {block.device}")
        self._blocks[block_id] = block.contiguous()

    def gather(self, block_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """KV of a chain of (one or more) blocks: (keys, values), each [L, H, len(block_ids) * B, D] (copies)."""
        self._check(block_ids, "gather")
        kv = torch.cat([self._blocks[i] for i in block_ids], dim=3)  # [2, L, H, n*B, D]
        return kv[0], kv[1]

    def _check(self, block_ids: Sequence[int], what: str, why: str = "freed or never put") -> None:
        if missing := [i for i in block_ids if i not in self._blocks]:
            raise KeyError(f"BlockStore.{what}: blocks {missing} are not stored ({why})")

    def page(self, tail: tuple[int, int] | None) -> torch.Tensor:
        """A new block [2, L, H, B, D] for a request to write (a paged KVCache's page), whose first k tokens are a
        copy of those of block ``tail`` = (id, k), if given: a partly reused block."""
        out = self.take()
        if tail is not None:
            self._check([tail[0]], "page")
            if not 0 <= tail[1] < self.block_size:
                raise ValueError(f"BlockStore.page: a tail reads 0..{self.block_size - 1} tokens of a block, "
                                 f"not {tail[1]}")
            out[:, :, :, : tail[1]] = self._blocks[tail[0]][:, :, :, : tail[1]]
        return out

    def tensors(self, block_ids: Sequence[int]) -> list[torch.Tensor]:
        """The blocks' own [2, L, H, B, D] tensors, in order (for saving: blocks are immutable once put, so
        these stay valid after the store frees them, and reading them copies nothing)."""
        return [self._blocks[i] for i in block_ids]

    def free(self, block_ids: Iterable[int]) -> None:
        block_ids = list(block_ids)
        self._check(block_ids, "free", "freed twice?")
        if len(set(block_ids)) != len(block_ids):
            raise KeyError(f"BlockStore.free: a block is listed twice in {block_ids}")
        for block_id in block_ids:
            del self._blocks[block_id]

    def check_integrity(self) -> None:
        """Raise AssertionError if a stored block has the wrong layout or shares memory."""
        pointers: dict[int, torch.Tensor] = {}  # (one block under two ids: a skill block's placement, shared)
        for block_id, block in self._blocks.items():
            assert tuple(block.shape) == self.block_shape, f"block {block_id} has shape {tuple(block.shape)}"
            assert block.dtype == self.dtype and block.device == self.device, f"block {block_id} dtype/device"
            assert block.is_contiguous(), f"block {block_id} is not contiguous"
            assert block.nbytes == self.bytes_per_block
            assert pointers.setdefault(block.data_ptr(), block) is block, "two blocks share storage"
