"""PrefixIndex: unit tests per method, a hypothesis state machine against a model, and a
long random serving workload under a small budget."""

import ast
import random
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvtool.cache import index as index_module
from kvtool.cache.index import EVICTION_POLICIES, IndexStats, PrefixIndex, common_prefix
from kvtool.errors import InvalidParameterError


def seq(*blocks):
    """Tokens from blocks given as strings of digits: seq("12", "34") == [1, 2, 3, 4]."""
    return [int(c) for b in blocks for c in b]


# ---- unit tests ------------------------------------------------------------------------


def test_index_module_imports_no_torch_or_numpy():
    tree = ast.parse(Path(index_module.__file__).read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not imported & {"torch", "numpy"}


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(block_size=0), "block_size"),
        (dict(capacity_blocks=-1), "capacity_blocks"),
        (dict(eviction="nope"), "lru"),  # the message lists the choices
    ],
)
def test_bad_parameters_say_what_is_wrong(kwargs, words):
    with pytest.raises(InvalidParameterError, match=words):
        PrefixIndex(**kwargs)


def test_insert_then_match_uses_full_blocks_only():
    idx = PrefixIndex(block_size=2, capacity_blocks=8)
    assert idx.match(seq("12", "34")) == []
    result = idx.insert(seq("12", "34", "5"))  # trailing partial block is not cached
    assert [i for i, _ in result.new] == [0, 1]
    assert [b for _, b in result.new] == result.block_ids
    assert result.evicted == []
    assert idx.num_blocks == 2
    assert idx.match(seq("12", "34", "56")) == result.block_ids
    assert idx.match(seq("12", "3")) == result.block_ids[:1]
    assert idx.match(seq("1")) == []
    idx.check_integrity()


def test_match_tail_finds_the_block_that_shares_most_after_the_chain():
    idx = PrefixIndex(block_size=4, capacity_blocks=8)
    a = idx.insert(seq("1234", "5678")).block_ids
    b = idx.insert(seq("1234", "5699")).block_ids
    root = idx.insert(seq("9999")).block_ids
    chain = idx.match(seq("1234", "567"))
    assert chain == a[:1] and idx.match_tail(seq("1234", "567"), chain) == (a[1], 3)
    assert idx.match_tail(seq("1234", "569", "1"), chain) == (b[1], 3)  # the sibling that shares more
    assert idx.match_tail(seq("1234", "5"), chain) == (a[1], 1)  # a tie goes to the older block
    assert idx.match_tail(seq("1234", "0"), chain) is None
    assert idx.match_tail(seq("99"), []) == (root[0], 2)  # before any full block: the roots
    last = idx._blocks[b[1]].last_used
    idx.match_tail(seq("1234", "569"), chain)
    assert idx._blocks[b[1]].last_used > last  # touched: the slice counts as a use for eviction
    idx.check_integrity()


def test_reinsert_creates_nothing_and_diverging_suffix_shares_the_prefix():
    idx = PrefixIndex(block_size=2, capacity_blocks=8)
    a = idx.insert(seq("12", "34")).block_ids
    again = idx.insert(seq("12", "34"))
    assert again.new == [] and again.block_ids == a
    b = idx.insert(seq("12", "56"))
    assert b.block_ids[0] == a[0] and b.new == [(1, b.block_ids[1])]
    assert idx.num_blocks == 3
    idx.check_integrity()


def test_same_tokens_under_different_parents_are_different_blocks():
    idx = PrefixIndex(block_size=2, capacity_blocks=8)
    deep = idx.insert(seq("12", "34")).block_ids
    assert idx.match(seq("34")) == []  # "34" exists only below "12"
    root = idx.insert(seq("34")).block_ids
    assert root[0] != deep[1]


def test_stats_count_recorded_queries_only():
    idx = PrefixIndex(block_size=2)
    assert IndexStats().hit_rate == 0.0
    idx.insert(seq("12", "34"))
    idx.match(seq("12", "34", "5"))  # 4 of 5 tokens hit
    idx.match(seq("99", "9"))  # 0 of 3
    idx.match(seq("12"), record=False)
    s = idx.stats
    assert (s.queries, s.query_tokens, s.hit_tokens, s.inserted_blocks) == (2, 8, 4, 2)
    assert s.hit_rate == 0.5


def test_lru_evicts_the_least_recently_used_leaf():
    idx = PrefixIndex(block_size=1, capacity_blocks=2)
    a = idx.insert([1]).block_ids
    b = idx.insert([2]).block_ids
    idx.match([1])  # now [2] is least recently used
    result = idx.insert([3])
    assert result.evicted == b
    assert idx.match([1]) == a
    assert idx.stats.evictions == 1
    idx.insert([3])  # inserting an existing chain is a use too: [1] is now the oldest
    assert idx.insert([4]).evicted == a


def test_eviction_takes_leaves_first_and_cascades_to_parents():
    idx = PrefixIndex(block_size=1, capacity_blocks=3)
    chain = idx.insert([1, 2, 3]).block_ids
    result = idx.insert([7, 8, 9])
    assert result.evicted == chain[::-1]  # the leaf goes first, then its parent, ...
    assert len(result.block_ids) == 3
    idx.check_integrity()


def test_insert_never_evicts_its_own_chain():
    idx = PrefixIndex(block_size=1, capacity_blocks=1)
    a = idx.insert([1]).block_ids
    result = idx.insert([1, 2])  # [1] is the only evictable leaf but is the new block's parent
    assert result.block_ids == a and result.new == [] and result.evicted == []
    idx.check_integrity()


def test_held_blocks_are_never_evicted_and_insert_stops_at_a_valid_prefix():
    idx = PrefixIndex(block_size=1, capacity_blocks=3)
    held = idx.insert([1, 2]).block_ids
    idx.acquire(held)
    result = idx.insert([5, 6, 7])  # one free slot, nothing evictable after that
    assert result.evicted == [] and len(result.block_ids) == 1
    assert idx.num_blocks == 3
    assert idx.evict_lru(10) == result.block_ids  # the unheld one only
    assert idx.match([1, 2]) == held
    assert idx.release(held) == []
    assert idx.evict_lru(10) == held[::-1]
    idx.check_integrity()


def test_acquire_and_release_reject_misuse():
    idx = PrefixIndex(block_size=1)
    ids = idx.insert([1]).block_ids
    with pytest.raises(ValueError, match="not in the index"):
        idx.acquire([12345])
    idx.acquire(ids)
    with pytest.raises(ValueError, match="held 1 times, released 2"):
        idx.release(ids + ids)
    assert idx.release(ids) == []  # the failed release changed nothing
    with pytest.raises(ValueError):
        idx.release(ids)


def test_pin_prefix_protects_until_unpinned_and_pins_stack():
    idx = PrefixIndex(block_size=2, capacity_blocks=4)
    ids = idx.insert(seq("12", "34")).block_ids
    assert idx.pin_prefix(seq("12", "34", "56")) == 4  # pins what is cached
    assert idx.pin_prefix(seq("12", "34")) == 4
    assert idx.pinned_blocks == 2
    assert idx.evict_lru(10) == []
    assert idx.unpin_prefix(seq("12", "34")) == []
    assert idx.evict_lru(10) == []  # still pinned once
    assert idx.unpin_prefix(seq("12", "34", "56")) == []
    assert idx.pinned_blocks == 0
    assert idx.evict_lru(10) == ids[::-1]
    with pytest.raises(ValueError, match="no pin"):
        idx.unpin_prefix(seq("12", "34"))


def test_reset_drops_everything_and_frees_held_blocks_on_release():
    idx = PrefixIndex(block_size=1, capacity_blocks=4)
    running = idx.insert([1, 2]).block_ids
    idle = idx.insert([3]).block_ids
    idx.acquire(running)
    idx.pin_prefix([3])
    assert sorted(idx.reset()) == idle
    assert idx.match([1, 2]) == [] and idx.match([3]) == []
    assert idx.num_blocks == 2 and len(idx._detached) == 2  # still resident, still budgeted
    assert idx.resident_ids() == set(running)
    with pytest.raises(ValueError, match="no pin"):
        idx.unpin_prefix([3])
    with pytest.raises(ValueError):
        idx.acquire(running)  # detached blocks cannot be taken again
    idx.check_integrity()
    assert sorted(idx.release(running)) == running
    assert idx.num_blocks == 0
    idx.check_integrity()


def test_set_capacity_evicts_down_and_release_finishes_the_job():
    idx = PrefixIndex(block_size=1, capacity_blocks=4)
    held = idx.insert([1, 2]).block_ids
    free = idx.insert([5, 6]).block_ids
    idx.acquire(held)
    assert idx.set_capacity(1) == free[::-1]
    assert idx.num_blocks == 2 and idx.capacity_blocks == 1  # over budget: all held
    idx.check_integrity()
    assert idx.insert([7]).block_ids == []  # no room: nothing is added
    assert idx.release(held) == [held[1]]  # back under budget at once
    assert idx.num_blocks == 1
    idx.check_integrity()


def test_capacity_zero_caches_nothing():
    idx = PrefixIndex(block_size=1, capacity_blocks=0)
    assert idx.insert([1, 2, 3]).block_ids == []
    assert idx.match([1, 2, 3]) == []


def test_eviction_policies_are_a_registry():
    assert {"lru", "fifo", "lfu"} <= set(EVICTION_POLICIES)
    fifo = PrefixIndex(block_size=1, capacity_blocks=2, eviction="fifo")
    first = fifo.insert([1]).block_ids
    fifo.insert([2])
    fifo.match([1])  # recency does not matter to FIFO
    assert fifo.insert([3]).evicted == first
    lfu = PrefixIndex(block_size=1, capacity_blocks=2, eviction="lfu")
    lfu.insert([1])
    rare = lfu.insert([2]).block_ids
    for _ in range(3):
        lfu.match([1])
    lfu.match([2])  # most recent, but least frequent
    assert lfu.insert([3]).evicted == rare


def test_check_integrity_catches_corruption():
    idx = PrefixIndex(block_size=1)
    ids = idx.insert([1, 2]).block_ids
    idx._blocks[ids[0]].children.clear()
    with pytest.raises(AssertionError):
        idx.check_integrity()
    idx = PrefixIndex(block_size=1)
    ids = idx.insert([1]).block_ids
    idx._blocks[ids[0]].refcount = -1
    with pytest.raises(AssertionError):
        idx.check_integrity()


# ---- state machine against a model ---------------------------------------------------

BLOCK_SIZE = 2


class PrefixIndexMachine(RuleBasedStateMachine):
    """Drives the index like an engine plus a store would, and tracks what the store holds."""

    @initialize(capacity=st.integers(0, 10), policy=st.sampled_from(sorted(EVICTION_POLICIES)))
    def start(self, capacity, policy):
        self.index = PrefixIndex(block_size=BLOCK_SIZE, capacity_blocks=capacity, eviction=policy)
        self.content: dict[int, tuple] = {}  # id -> the whole token prefix its block ends
        self.live: set[int] = set()  # in the tree
        self.resident: set[int] = set()  # what the store holds (live + detached)
        self.freed: set[int] = set()
        self.requests: list[list[int]] = []  # ids held by running requests
        self.pins: list[tuple] = []  # pinned token prefixes, as the model knows them
        self.pinned = Counter()
        self.hit_tokens = 0

    def held(self):
        return Counter(i for ids in self.requests for i in ids)

    def free(self, ids):
        held = self.held()
        for i in ids:
            assert i in self.resident and i not in self.freed, f"{i} freed twice or never stored"
            assert held[i] == 0, f"held block {i} was freed"
            assert self.pinned[i] == 0, f"pinned block {i} was freed"
            self.resident.discard(i)
            self.live.discard(i)
            self.freed.add(i)

    def check_chain(self, tokens, ids):
        for n, i in enumerate(ids):
            assert i in self.live and self.content[i] == tuple(tokens[: (n + 1) * BLOCK_SIZE])

    # a few long "documents" cut at random points plus a short random tail: lots of sharing
    tokens = st.builds(
        lambda doc, cut, tail: doc[:cut] + tail,
        st.sampled_from([[0, 1] * 5, [0, 1, 1, 0] * 3, [1, 1, 0, 0, 2, 2] * 2]),
        st.integers(0, 12),
        st.lists(st.integers(0, 2), max_size=3),
    )

    @rule(tokens=tokens)
    def match(self, tokens):
        ids = self.index.match(tokens)
        self.check_chain(tokens, ids)
        longer = tuple(tokens[: (len(ids) + 1) * BLOCK_SIZE])
        if len(longer) == (len(ids) + 1) * BLOCK_SIZE:  # the match is the longest one
            assert all(self.content[i] != longer for i in self.live)
        self.hit_tokens += len(ids) * BLOCK_SIZE
        assert self.index.stats.hit_tokens == self.hit_tokens

    @rule(tokens=tokens)
    def match_tail(self, tokens):
        ids = self.index.match(tokens, record=False)
        start = len(ids) * BLOCK_SIZE
        rest = tuple(tokens[start : start + BLOCK_SIZE])
        shared = {}  # children of the matched chain -> leading tokens they share with the rest
        for i in self.live:
            c = self.content[i]
            if len(c) == start + BLOCK_SIZE and c[:start] == tuple(tokens[:start]):
                shared[i] = common_prefix(c[start:], rest)
        best = max(shared.values(), default=0)
        want = (min(i for i, k in shared.items() if k == best), best) if best else None
        assert self.index.match_tail(tokens, ids) == want and (want is None or 0 < want[1] < BLOCK_SIZE)

    def _insert(self, tokens):
        before = self.index.num_blocks
        result = self.index.insert(tokens)
        self.free(result.evicted)
        for n, i in result.new:
            assert i not in self.content, "a block id was reused"
            assert result.block_ids[n] == i
            self.content[i] = tuple(tokens[: (n + 1) * BLOCK_SIZE])
            self.live.add(i)
            self.resident.add(i)
        self.check_chain(tokens, result.block_ids)
        if len(result.block_ids) < len(tokens) // BLOCK_SIZE:
            assert self.index.num_blocks >= self.index.capacity_blocks
        assert self.index.num_blocks <= max(before, self.index.capacity_blocks)
        return result.block_ids

    @rule(tokens=tokens)
    def insert(self, tokens):
        self._insert(tokens)

    @rule(tokens=tokens)
    def start_request(self, tokens):
        ids = self._insert(tokens)
        self.index.acquire(ids)
        self.requests.append(ids)

    @rule(tokens=tokens)
    def start_request_from_match(self, tokens):
        ids = self.index.match(tokens, record=False)
        self.index.acquire(ids)
        self.requests.append(ids)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def finish_request(self, data):
        ids = self.requests.pop(data.draw(st.integers(0, len(self.requests) - 1)))
        freed = self.index.release(ids)
        self.free(freed)

    @rule(tokens=tokens)
    def pin(self, tokens):
        pinned = self.index.pin_prefix(tokens)
        ids = self.index.match(tokens[:pinned], record=False)
        assert len(ids) * BLOCK_SIZE == pinned
        self.pins.append((tuple(tokens[: len(tokens) // BLOCK_SIZE * BLOCK_SIZE]), ids))
        self.pinned.update(ids)

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data):
        # unpin undoes the latest pin of the same tokens
        key = self.pins[data.draw(st.integers(0, len(self.pins) - 1))][0]
        n = max(n for n, (k, _) in enumerate(self.pins) if k == key)
        _, ids = self.pins.pop(n)
        self.pinned.subtract(ids)
        self.free(self.index.unpin_prefix(list(key)))

    @rule(tokens=tokens)
    def unpin_unknown(self, tokens):
        key = tuple(tokens[: len(tokens) // BLOCK_SIZE * BLOCK_SIZE])
        if all(k != key for k, _ in self.pins):
            with pytest.raises(ValueError):
                self.index.unpin_prefix(tokens)

    @rule(n=st.integers(0, 4))
    def evict(self, n):
        evicted = self.index.evict_lru(n)
        assert len(evicted) <= n
        self.free(evicted)

    @rule(capacity=st.integers(0, 10))
    def set_capacity(self, capacity):
        self.free(self.index.set_capacity(capacity))

    @rule()
    def reset(self):
        freed = self.index.reset()
        self.pins.clear()  # reset drops pins too
        self.pinned.clear()
        self.free(freed)
        self.live.clear()
        assert self.index.resident_ids() == set(self.held())

    @invariant()
    def consistent(self):
        self.index.check_integrity()
        assert self.index.resident_ids() == self.resident
        assert self.index.num_blocks == len(self.resident)
        assert self.index.pinned_blocks == sum(1 for i in self.pinned if self.pinned[i] > 0)
        held = self.held()
        assert all(i in self.resident for i in held)
        if self.index.num_blocks > self.index.capacity_blocks:
            # over budget only when every live leaf is held or pinned
            parents = {i for i in self.live for j in self.live if self.content[j][:-BLOCK_SIZE] == self.content[i]}
            assert all(held[i] or self.pinned[i] for i in self.live - parents)


PrefixIndexMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestPrefixIndexMachine = PrefixIndexMachine.TestCase


# ---- long random workload ---------------------------------------------------------------


def test_long_random_workload_stays_in_budget():
    rng = random.Random(0)
    idx = PrefixIndex(block_size=4, capacity_blocks=48)
    system_prompts = [[rng.randrange(50) for _ in range(rng.randrange(0, 40))] for _ in range(6)]
    running: list[list[int]] = []
    resident: set[int] = set()
    freed: set[int] = set()

    def free(ids):
        assert not set(ids) & freed and set(ids) <= resident
        resident.difference_update(ids)
        freed.update(ids)

    for step in range(3000):
        prompt = rng.choice(system_prompts) + [rng.randrange(50) for _ in range(rng.randrange(0, 24))]
        idx.match(prompt[:-1])
        result = idx.insert(prompt)
        free(result.evicted)
        resident.update(b for _, b in result.new)
        idx.acquire(result.block_ids)
        running.append(result.block_ids)
        if len(running) > rng.randrange(1, 6):
            free(idx.release(running.pop(rng.randrange(len(running)))))
        if step % 97 == 0:
            free(idx.set_capacity(rng.choice([8, 16, 48, 64])))
        if step % 211 == 0:
            p = rng.choice(system_prompts)
            idx.pin_prefix(p)
            free(idx.unpin_prefix(p) if rng.random() < 0.5 else [])
        if step % 997 == 0:
            free(idx.reset())
        assert idx.num_blocks <= idx.capacity_blocks or idx.evict_lru(0) == []
        assert idx.resident_ids() == resident
        idx.check_integrity()
    assert idx.stats.hit_rate > 0.3
