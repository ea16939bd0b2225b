"""What the prefix cache holds, as a tree of segments: the shared prefixes and where requests diverge.

A segment is a maximal run of blocks each with exactly one cached child (a radix-tree node over the
block chains); its children are the continuations that diverge after it. For a context engineer this
is the picture behind the hit rate: one long system-prompt segment with many short conversation
children is a cache doing its job; many roots that differ in their first block mean a prefix that
changes per request (a timestamp, a re-ordered tool list). Pure Python over PrefixIndex.snapshot().
"""

from __future__ import annotations

import os


def segments(blocks, block_size: int) -> list[dict]:
    """Root segments, children nested: start/tokens (positions), block_ids, token_ids, pinned_tokens and in_use_tokens
    (blocks with a permanent pin / held by a running request), hits (lookups and inserts that walked into it).
    Built with a stack, not recursion: a long chat that diverges every turn nests hundreds deep."""
    by_id = {b.id: b for b in blocks}
    roots: list[dict] = []
    todo = [(b, 0, roots) for b in blocks if b.parent is None]
    while todo:
        first, start, siblings = todo.pop()
        run = [first]
        while len(run[-1].children) == 1:
            run.append(by_id[next(iter(run[-1].children))])
        segment = {"start": start, "tokens": len(run) * block_size, "block_ids": [b.id for b in run],
                   "token_ids": [t for b in run for t in b.tokens],
                   "pinned_tokens": sum(block_size for b in run if b.pins),
                   "in_use_tokens": sum(block_size for b in run if b.refcount), "hits": first.hits, "children": []}
        siblings.append(segment)
        todo += [(by_id[c], start + segment["tokens"], segment["children"]) for c in run[-1].children]
    order = [roots]
    while order:  # most visited first, at every level
        level = order.pop()
        level.sort(key=lambda s: (-s["hits"], s["block_ids"][0]))
        order += [s["children"] for s in level]
    return roots


def walk(tree: list[dict]):
    """Every segment of a tree, parents before children."""
    todo = list(reversed(tree))
    while todo:
        segment = todo.pop()
        yield segment
        todo += reversed(segment["children"])


def add_text(tree: list[dict], decode, max_chars: int) -> None:
    """Give every segment its text, decode(token_ids), cut to its first and last max_chars / 2 characters."""
    half = max_chars // 2
    for segment in walk(tree):
        text = decode(segment["token_ids"])
        segment["text"] = text if len(text) <= max_chars else f"{text[:half]} … {text[len(text) - half:]}"


def fork_of(tree: list[dict], text_of, chars: int = 24) -> dict:
    """Where a tree's chains first part: the roots, the token position of the first fork (None: one chain) and
    each branch's text (text_of(segment)) from a little before the branches differ (forks are at block
    boundaries), ``chars`` long; at most four branches."""
    level, at = tree, 0
    while len(level) == 1:
        at, level = level[0]["start"] + level[0]["tokens"], level[0]["children"]
    texts = [text_of(s) for s in level[:4]]
    same = max(0, len(os.path.commonprefix(texts)) - 4) if len(texts) > 1 else 0
    return {"roots": len(tree), "fork_at_token": at if level else None,
            "branches": [("…" if same else "") + t[same : same + chars] for t in texts]}
