"""The prefix cache as a tree of segments (kvtool.cache.tree): every block once, children where requests
diverge, pins and holders counted; and GET /v1/cache/tree over a tiny model."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtool.cache.index import PrefixIndex
from kvtool.cache.tree import segments, walk


def check_tree(index: PrefixIndex) -> list[dict]:
    blocks, _ = index.snapshot()
    tree = segments(blocks, index.block_size)
    by_id = {b.id: b for b in blocks}
    seen = [i for s in walk(tree) for i in s["block_ids"]]
    assert sorted(seen) == sorted(by_id)  # every live block in exactly one segment
    for s in walk(tree):
        run = [by_id[i] for i in s["block_ids"]]
        assert all(len(b.children) == 1 for b in run[:-1]) and len(run[-1].children) == len(s["children"]) != 1
        assert s["token_ids"] == [t for b in run for t in b.tokens] and s["tokens"] == len(run) * index.block_size
        assert all(c["start"] == s["start"] + s["tokens"] for c in s["children"])
        assert s["pinned_tokens"] == index.block_size * sum(1 for b in run if b.pins)
    assert all(s["start"] == 0 for s in tree)
    return tree


def test_a_shared_system_prompt_is_one_segment_with_a_child_per_conversation():
    index = PrefixIndex(block_size=4, capacity_blocks=100)
    system = list(range(100, 112))
    for user in ([1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [7, 7, 7, 7]):
        index.match(system + user)
        index.insert(system + user)
    index.insert([50, 51, 52, 53, 54, 55, 56, 57])  # another prefix, never looked up
    index.pin_prefix(system[:8])
    index.acquire(index.match(system + [7, 7, 7, 7], record=False))
    tree = check_tree(index)
    assert [(s["tokens"], s["hits"]) for s in tree] == [(12, 6), (8, 1)]  # most walked first
    shared = tree[0]
    assert shared["pinned_tokens"] == 8 and shared["in_use_tokens"] == 12
    assert [(c["start"], c["tokens"], len(c["children"])) for c in shared["children"]] == [(12, 4, 2), (12, 4, 0)]
    assert shared["children"][1]["in_use_tokens"] == 4  # the [7, 7, 7, 7] conversation is held


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6), n=st.integers(1, 40))
def test_random_workloads_give_a_consistent_tree(seed, n):
    rng = random.Random(seed)
    index = PrefixIndex(block_size=2, capacity_blocks=rng.randint(4, 40))
    for _ in range(n):
        tokens = [rng.randint(0, 3) for _ in range(rng.randint(0, 16))]
        op = rng.random()
        if op < 0.7:
            index.insert(tokens)
        elif op < 0.85:
            index.pin_prefix(tokens)
        else:
            index.evict_lru(rng.randint(1, 3))
    check_tree(index)


def test_a_chat_that_diverges_every_turn_nests_deeper_than_python_recursion():
    index = PrefixIndex(block_size=1, capacity_blocks=5000)
    for depth in range(1, 1500):
        index.insert([0] * depth + [1])  # each turn ends differently from the next one's history
    tree = check_tree(index)
    depth, level = 0, tree
    while level:
        depth, level = depth + 1, level[0]["children"]
    assert depth >= 1499
