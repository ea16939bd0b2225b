"""The prefix index's records (a block, its statistics, what an insert did) and the eviction policies
that order its evictable leaves.

A policy maps a block to a priority key; the evictable leaf with the smallest key goes first. Keys may
only depend on fields whose changes re-offer the block to the eviction heap (PrefixIndex._offer).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass(slots=True, eq=False)
class Block:
    id: int
    parent: int | None
    tokens: tuple[int, ...]
    created: int  # clock value at creation
    last_used: int  # clock value of the last match/insert/release touching it
    hits: int = 0  # number of match/insert walks that went through it
    refcount: int = 0  # holders: running requests (acquire/release)
    pins: int = 0  # permanent pins (pin_prefix/unpin_prefix)
    children: set[int] = field(default_factory=set)


@dataclass
class IndexStats:
    queries: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    inserted_blocks: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


@dataclass
class InsertResult:
    new: list[tuple[int, int]]  # (block_index, block_id): store must put KV of tokens[i*bs:(i+1)*bs]
    evicted: list[int]  # ids the store must free
    block_ids: list[int]  # the full chain that exists after the insert (may stop early when full)


EvictionPolicy = Callable[[Block], tuple]
EVICTION_POLICIES: dict[str, EvictionPolicy] = {}


def register_eviction_policy(name: str) -> Callable[[EvictionPolicy], EvictionPolicy]:
    def register(policy: EvictionPolicy) -> EvictionPolicy:
        EVICTION_POLICIES[name] = policy
        return policy

    return register


@register_eviction_policy("lru")
def _least_recently_used(block: Block) -> tuple:
    return (block.last_used,)


@register_eviction_policy("fifo")
def _first_in_first_out(block: Block) -> tuple:
    return (block.created,)


@register_eviction_policy("lfu")
def _least_frequently_used(block: Block) -> tuple:
    return (block.hits, block.last_used)
