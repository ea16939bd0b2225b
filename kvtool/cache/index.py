"""Prefix index over token ids: which full KV blocks can a new request reuse?

Automatic prefix caching across requests, in the spirit of vLLM's APC and SGLang's radix cache. The unit of sharing
is a *full block* of ``block_size`` tokens. A block is keyed by ``(parent_block_id, tuple(its tokens))``: an exact
dict key, so two different prefixes can never collide (no hashing of token content), and the blocks form a tree
whose roots have no parent. A request's cached prefix is the chain of blocks walked from a root.

Why chained blocks rather than a radix tree over tokens: a radix tree splits a node when a new request diverges
inside it, and the KV storage behind the node would have to split its tensors with it. Fixed blocks never split, so
the store keeps one immutable tensor per block id. A shared prefix that ends inside a block is still reused to the
token: match_tail() finds the child of the matched chain that shares the most leading tokens with the request, and
the caller reads that many tokens' KV out of the block (a slice; the block stays whole).

Memory budget: ``capacity_blocks`` bounds every block whose KV the store holds, including blocks that ``reset()``
detached from the tree while running requests still hold them. Block ids are never reused, so a stale id can never
alias a newer block.

Eviction only ever removes a leaf with no holder (refcount 0) and no permanent pin; which such leaf goes first is an
interchangeable policy from ``EVICTION_POLICIES``. Holders and pins protect their ancestors for free: an ancestor
has a child, so it is not a leaf.

Pure Python bookkeeping (no torch): every call that frees KV returns the ids the store must free, and the caller
frees exactly those.
"""

from __future__ import annotations

import heapq
import os
from collections import Counter
from typing import Iterable, Sequence

from kvtool.cache.eviction import EVICTION_POLICIES, Block, IndexStats, InsertResult, register_eviction_policy
from kvtool.errors import InvalidParameterError

__all__ = ["EVICTION_POLICIES", "Block", "IndexStats", "InsertResult", "PrefixIndex", "common_prefix",
           "register_eviction_policy"]

BlockKey = tuple  # (parent id or None, tuple of block_size token ids)


class PrefixIndex:
    def __init__(self, block_size: int = 16, capacity_blocks: int = 1024, eviction: str = "lru"):
        if not isinstance(block_size, int) or block_size < 1:
            raise InvalidParameterError(f"block_size must be a positive int, got {block_size!r}")
        _check_capacity(capacity_blocks)
        if eviction not in EVICTION_POLICIES:
            raise InvalidParameterError(f"unknown eviction policy {eviction!r}; choose one of "
                                        f"{sorted(EVICTION_POLICIES)}")
        self.block_size, self.capacity_blocks, self.eviction = block_size, capacity_blocks, eviction
        self._priority = EVICTION_POLICIES[eviction]
        self.stats = IndexStats()
        self._blocks: dict[int, Block] = {}  # live blocks, reachable from a root
        self._by_key: dict[BlockKey, int] = {}
        self._roots: set[int] = set()  # live blocks without a parent (match_tail's candidates at the start)
        self._detached: dict[int, int] = {}  # id -> refcount of blocks dropped by reset() but still held
        self._evictable: list[tuple[tuple, int]] = []  # heap of (priority, id); stale entries skipped
        self._pin_records: dict[tuple[int, ...], list[list[int]]] = {}  # pinned tokens -> stack of id lists
        self._clock = self._next_id = 0

    # ---- queries -------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        """Blocks whose KV the store holds: live ones plus detached ones still acquired."""
        return len(self._blocks) + len(self._detached)

    @property
    def pinned_blocks(self) -> int:
        """Live blocks with at least one permanent pin (acquired blocks are not counted)."""
        return sum(1 for b in self._blocks.values() if b.pins)

    def resident_ids(self) -> set[int]:
        """Ids the store should hold right now (to cross-check against the store)."""
        return set(self._blocks) | set(self._detached)

    def match(self, tokens: Sequence[int], *, record: bool = True) -> list[int]:
        """Ids of the longest cached prefix of full blocks; touches them for eviction order.

        The caller decides how much of a full hit to reuse (an engine usually matches
        tokens[:-1] so at least one token is computed to get logits).
        """
        ids = []
        for block in self._walk(tokens):
            self._touch(block)
            ids.append(block.id)
        if record:
            self.stats.queries += 1
            self.stats.query_tokens += len(tokens)
            self.stats.hit_tokens += len(ids) * self.block_size
        return ids

    def match_tail(self, tokens: Sequence[int], chain: Sequence[int]) -> tuple[int, int] | None:
        """After ``chain`` (what match() returned for ``tokens``): the child of its last block (a root when it
        is empty) whose leading tokens agree longest with the tokens that follow it, as (block id, k) with
        0 < k < block_size, or None. Touches that block; its first k tokens' KV is the request's too."""
        start = len(chain) * self.block_size
        rest = tokens[start : start + self.block_size]
        candidates = self._blocks[chain[-1]].children if chain else self._roots
        k, neg_id = max(((common_prefix(self._blocks[i].tokens, rest), -i) for i in candidates), default=(0, 0))
        if not k:
            return None
        self._touch(self._blocks[-neg_id])  # ties go to the oldest block
        return -neg_id, k

    def snapshot(self) -> tuple[list[Block], list[tuple[int, ...]]]:
        """Live blocks, parents before children (a parent exists when its child is created, and ids
        grow), and the tokens of every permanent pin, once per pin (for saving; kvtool.cache.persist)."""
        blocks = [self._blocks[i] for i in sorted(self._blocks)]
        return blocks, [key for key, stack in self._pin_records.items() for _ in stack]

    # ---- mutation ------------------------------------------------------------------------

    def insert(self, tokens: Sequence[int]) -> InsertResult:
        """Walk or create the chain for every full block of ``tokens``, evicting if needed.

        Stops early (the chain stays a valid prefix) when no evictable block is left; never
        evicts a block of the chain being inserted and never exceeds capacity.
        """
        bs = self.block_size
        new: list[tuple[int, int]] = []
        evicted: list[int] = []
        chain: list[int] = []
        parent: int | None = None
        for i in range(len(tokens) // bs):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            block_id = self._by_key.get((parent, chunk))
            if block_id is None:
                while self.num_blocks >= self.capacity_blocks:
                    victim = self._evict_one(protect=parent)
                    if victim is None:
                        return InsertResult(new, evicted, chain)
                    evicted.append(victim)
                block_id = self._create(parent, chunk)
                new.append((i, block_id))
            else:
                self._touch(self._blocks[block_id])
            chain.append(block_id)
            parent = block_id
        return InsertResult(new, evicted, chain)

    def acquire(self, block_ids: Iterable[int]) -> None:
        """Hold blocks for a running request; held blocks (and their ancestors) never evict."""
        block_ids = list(block_ids)
        for block_id in block_ids:
            if block_id not in self._blocks:
                raise ValueError(f"acquire: block {block_id} is not in the index (evicted or reset?)")
        for block_id in block_ids:
            self._blocks[block_id].refcount += 1

    def release(self, block_ids: Iterable[int]) -> list[int]:
        """Drop holds taken by acquire(). Returns ids the store must free now: detached blocks
        whose last holder left, and evictions needed to get back under a lowered capacity."""
        counts = Counter(block_ids)
        for block_id, n in counts.items():
            held = self._refcount(block_id)
            if held < n:
                raise ValueError(f"release: block {block_id} is held {held} times, released {n} times")
        freed = []
        for block_id, n in counts.items():
            if block_id in self._detached:
                self._detached[block_id] -= n
                if self._detached[block_id] == 0:
                    del self._detached[block_id]
                    freed.append(block_id)
            else:
                block = self._blocks[block_id]
                block.refcount -= n
                self._touch(block)  # the request used it until now
        return freed + self._evict_down()

    def pin_prefix(self, tokens: Sequence[int]) -> int:
        """Permanently pin the full blocks of ``tokens`` that are cached now (inserting is the
        caller's job). Returns the number of tokens pinned. Pins stack; reset() drops them."""
        ids = [block.id for block in self._walk(tokens)]
        for block_id in ids:
            self._blocks[block_id].pins += 1
        self._pin_records.setdefault(self._full_tokens(tokens), []).append(ids)
        return len(ids) * self.block_size

    def unpin_prefix(self, tokens: Sequence[int]) -> list[int]:
        """Undo the latest pin_prefix() of the same tokens. Returns ids the store must free
        (only non-empty when the capacity was lowered below what the pins were holding)."""
        key = self._full_tokens(tokens)
        stack = self._pin_records.get(key)
        if not stack:
            raise ValueError(f"unpin_prefix: no pin for these {len(key)} tokens (never pinned, already unpinned, or "
                             "dropped by reset())")
        for block_id in stack.pop():
            block = self._blocks[block_id]
            block.pins -= 1
            self._offer(block)
        if not stack:
            del self._pin_records[key]
        return self._evict_down()

    def evict_lru(self, n_blocks: int) -> list[int]:
        """Evict up to ``n_blocks`` evictable blocks, in the order of the eviction policy."""
        evicted = []
        while len(evicted) < n_blocks:
            victim = self._evict_one()
            if victim is None:
                break
            evicted.append(victim)
        return evicted

    def set_capacity(self, capacity_blocks: int) -> list[int]:
        """Change the budget and evict down to it as far as possible. If held or pinned blocks
        keep the index over budget, later release()/unpin_prefix() finish the job."""
        _check_capacity(capacity_blocks)
        self.capacity_blocks = capacity_blocks
        return self._evict_down()

    def reset(self) -> list[int]:
        """Drop every block and pin from the index. Returns ids the store may free now; held
        blocks stay resident (detached) until their last release() returns them."""
        freed = []
        for block in self._blocks.values():
            if block.refcount:
                self._detached[block.id] = block.refcount
            else:
                freed.append(block.id)
        self._blocks.clear()
        self._by_key.clear()
        self._roots.clear()
        self._evictable.clear()
        self._pin_records.clear()
        return freed

    # ---- internals -----------------------------------------------------------------------

    def _walk(self, tokens: Sequence[int]) -> Iterable[Block]:
        bs = self.block_size
        parent = None
        for i in range(len(tokens) // bs):
            block_id = self._by_key.get((parent, tuple(tokens[i * bs : (i + 1) * bs])))
            if block_id is None:
                return
            yield self._blocks[block_id]
            parent = block_id

    def _full_tokens(self, tokens: Sequence[int]) -> tuple[int, ...]:
        return tuple(tokens[: len(tokens) // self.block_size * self.block_size])

    def _refcount(self, block_id: int) -> int:
        if block_id in self._blocks:
            return self._blocks[block_id].refcount
        return self._detached.get(block_id, 0)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _touch(self, block: Block) -> None:
        block.last_used = self._tick()
        block.hits += 1
        self._offer(block)

    def _create(self, parent: int | None, chunk: tuple[int, ...]) -> int:
        block_id = self._next_id
        self._next_id += 1
        now = self._tick()
        block = Block(block_id, parent, chunk, created=now, last_used=now, hits=1)
        self._blocks[block_id] = block
        self._by_key[(parent, chunk)] = block_id
        (self._blocks[parent].children if parent is not None else self._roots).add(block_id)
        self.stats.inserted_blocks += 1
        self._offer(block)
        return block_id

    def _is_evictable(self, block: Block) -> bool:
        return not block.children and not block.refcount and not block.pins

    def _offer(self, block: Block) -> None:
        """Push a heap entry for ``block`` if evictable; call after any change to its state."""
        if self._is_evictable(block):
            heapq.heappush(self._evictable, (self._priority(block), block.id))
            self._maybe_compact()

    def _maybe_compact(self) -> None:
        """Drop stale heap entries once they outnumber live blocks (keeps memory O(blocks))."""
        if len(self._evictable) > 2 * len(self._blocks) + 64:
            self._evictable = [(self._priority(b), b.id) for b in self._blocks.values() if self._is_evictable(b)]
            heapq.heapify(self._evictable)

    def _evict_one(self, protect: int | None = None) -> int | None:
        """Remove the policy's first evictable leaf other than ``protect``; None if there is none."""
        skipped = []
        victim = None
        while self._evictable:
            entry = heapq.heappop(self._evictable)
            priority, block_id = entry
            block = self._blocks.get(block_id)
            if block is None or not self._is_evictable(block) or self._priority(block) != priority:
                continue  # stale entry: evicted, no longer a free leaf, or touched since
            if block_id == protect:
                skipped.append(entry)
                continue
            victim = block
            break
        for entry in skipped:
            heapq.heappush(self._evictable, entry)
        if victim is None:
            return None
        del self._blocks[victim.id]
        del self._by_key[(victim.parent, victim.tokens)]
        if victim.parent is not None:
            parent = self._blocks[victim.parent]
            parent.children.discard(victim.id)
            self._offer(parent)
        else:
            self._roots.discard(victim.id)
        self.stats.evictions += 1
        self._maybe_compact()
        return victim.id

    def _evict_down(self) -> list[int]:
        return self.evict_lru(max(0, self.num_blocks - self.capacity_blocks))

    # ---- invariants ----------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise AssertionError if any bookkeeping invariant is broken."""
        bs = self.block_size
        blocks = self._blocks
        assert len(self._by_key) == len(blocks), "key map and block table differ in size"
        assert not set(blocks) & set(self._detached), "a block is both live and detached"
        for block_id, held in self._detached.items():
            assert held > 0, f"detached block {block_id} has refcount {held}; it should be freed"
            assert block_id < self._next_id
        heap_entries = set(self._evictable)
        assert len(self._evictable) <= 2 * len(blocks) + 64, "eviction heap is not being compacted"
        pins = Counter(i for stack in self._pin_records.values() for ids in stack for i in ids)
        n_child_links = 0
        for block_id, block in blocks.items():
            assert block.id == block_id
            assert block_id < self._next_id
            assert len(block.tokens) == bs, f"block {block_id} holds {len(block.tokens)} tokens, not {bs}"
            assert self._by_key.get((block.parent, block.tokens)) == block_id, f"block {block_id} key lost"
            assert block.refcount >= 0 and block.pins >= 0, f"block {block_id} has a negative count"
            assert block.pins == pins[block_id], f"block {block_id} pins disagree with pin records"
            assert block.created <= block.last_used <= self._clock
            if block.parent is not None:
                # parent ids are smaller than child ids, so the parent links have no cycles
                # and every live block reaches a root.
                assert block.parent in blocks, f"block {block_id} has a dead parent {block.parent}"
                assert block.parent < block_id
                assert block_id in blocks[block.parent].children, f"parent of {block_id} does not list it"
            for child in block.children:
                assert child in blocks and blocks[child].parent == block_id, f"bad child link {block_id}->{child}"
            n_child_links += len(block.children)
            if self._is_evictable(block):
                assert (self._priority(block), block_id) in heap_entries, f"evictable {block_id} not in heap"
        assert n_child_links == sum(1 for b in blocks.values() if b.parent is not None)
        assert self._roots == {i for i, b in blocks.items() if b.parent is None}, "root set out of date"
        has_evictable = any(self._is_evictable(b) for b in blocks.values())
        assert self.num_blocks <= self.capacity_blocks or not has_evictable, \
            f"{self.num_blocks} blocks over capacity {self.capacity_blocks} with evictable blocks left"
        s = self.stats
        assert min(s.queries, s.query_tokens, s.hit_tokens, s.inserted_blocks, s.evictions) >= 0
        assert s.hit_tokens <= s.query_tokens


def _check_capacity(capacity_blocks: int) -> None:
    if not isinstance(capacity_blocks, int) or capacity_blocks < 0:
        raise InvalidParameterError(f"capacity_blocks must be an int >= 0 (0 disables caching), "
                                    f"got {capacity_blocks!r}")


def common_prefix(a: Sequence, b: Sequence) -> int:
    """How many leading items ``a`` and ``b`` have in common."""
    return len(os.path.commonprefix([list(a), list(b)]))
