"""BlockIndex: pure-Python exact matching of block token ids inside prompts (property tests)."""

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtool.skills.match import BlockIndex, Match


def naive(prompt, blocks):
    out, i = [], 0
    order = sorted(blocks.items(), key=lambda kv: (-len(kv[1]), kv[0]))
    while i < len(prompt):
        for name, ids in order:
            if prompt[i:i + len(ids)] == list(ids):
                out.append(Match(name, i, i + len(ids)))
                i += len(ids)
                break
        else:
            i += 1
    return out


tokens = st.integers(0, 6)


@settings(max_examples=200, deadline=None)
@given(blocks=st.dictionaries(st.sampled_from("abcdef"), st.lists(tokens, min_size=1, max_size=6), max_size=4),
       prompt=st.lists(tokens, max_size=60))
def test_find_equals_naive_leftmost_longest(blocks, prompt):
    index = BlockIndex()
    for name, ids in blocks.items():
        index.add(name, ids)
        index.check_integrity()
    found = index.find(prompt)
    assert found == naive(prompt, blocks)
    for m in found:
        assert prompt[m.start:m.end] == blocks[m.name]
    assert all(a.end <= b.start for a, b in zip(found, found[1:]))


@settings(max_examples=100, deadline=None)
@given(parts=st.lists(st.lists(st.integers(100, 200), max_size=5), min_size=3, max_size=3))
def test_planted_blocks_are_found(parts):
    index = BlockIndex()
    index.add("x", [1, 2, 3, 4])
    index.add("y", [1, 2, 5])
    prompt = parts[0] + [1, 2, 3, 4] + parts[1] + [1, 2, 5] + parts[2]
    assert [m.name for m in index.find(prompt)] == ["x", "y"]
    assert [m.name for m in index.find(prompt, start=len(parts[0]) + 1)] == ["y"]


def test_add_replace_remove_keep_integrity():
    index = BlockIndex()
    index.add("a", [1, 2])
    index.add("a", [3, 4])  # re-adding replaces
    index.add("b", [3])
    index.check_integrity()
    assert index.find([1, 2, 3, 4, 3]) == [Match("a", 2, 4), Match("b", 4, 5)]
    index.remove("a")
    index.check_integrity()
    assert index.names() == ["b"] and len(index) == 1 and "a" not in index


def test_choose_path_splices_long_blocks_and_prefills_short_ones():
    from kvtool.skills.match import Match, choose_path

    a, b = Match("a", 3, 43), Match("b", 45, 75)  # 40 and 30 tokens
    both = choose_path([a, b], 0, 35)
    assert both.path == "composed" and both.kept == [a] and both.skipped == [b]
    assert "a (40 tokens)" in both.reason and "b (30 tokens) shorter than skill_min_tokens=35" in both.reason
    short = choose_path([a, b], 0, 64)
    assert short.path == "prefilled" and not short.kept and short.skipped == [a, b]
    assert choose_path([a, b], 80, 0).path == "cached"  # both inside the prefix hit
    assert choose_path([a, b], 44, 0).kept == [b]
    assert choose_path([], 0, 0).reason == "no skill block in the prompt"
