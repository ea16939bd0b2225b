"""Find registered blocks' exact token ids inside a prompt. Pure Python: ints and lists, no torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Match:
    name: str
    start: int
    end: int  # exclusive


class BlockIndex:
    """Blocks keyed by their first token; find() returns leftmost, longest, non-overlapping matches."""

    def __init__(self):
        self._ids: dict[str, tuple[int, ...]] = {}
        self._by_first: dict[int, list[str]] = {}  # first token -> names, longest block first

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, name: str) -> bool:
        return name in self._ids

    def names(self) -> list[str]:
        return sorted(self._ids)

    def add(self, name: str, ids: Sequence[int]) -> None:
        ids = tuple(int(t) for t in ids)
        if not ids:
            raise ValueError(f"block {name!r} has no tokens")
        if name in self._ids:
            self.remove(name)
        self._ids[name] = ids
        names = self._by_first.setdefault(ids[0], [])
        names.append(name)
        names.sort(key=lambda n: (-len(self._ids[n]), n))

    def remove(self, name: str) -> None:
        ids = self._ids.pop(name)
        names = self._by_first[ids[0]]
        names.remove(name)
        if not names:
            del self._by_first[ids[0]]

    def find(self, prompt: Sequence[int], start: int = 0) -> list[Match]:
        prompt = list(prompt)
        n, i, out = len(prompt), max(0, start), []
        while i < n:
            for name in self._by_first.get(prompt[i], ()):
                ids = self._ids[name]
                end = i + len(ids)
                if end <= n and prompt[end - 1] == ids[-1] and tuple(prompt[i:end]) == ids:
                    out.append(Match(name, i, end))
                    i = end
                    break
            else:
                i += 1
        return out

    def check_integrity(self) -> None:
        listed = [name for names in self._by_first.values() for name in names]
        assert sorted(listed) == sorted(self._ids), "first-token index and blocks disagree"
        for first, names in self._by_first.items():
            assert names, f"empty bucket for token {first}"
            assert all(self._ids[n][0] == first for n in names), f"bucket {first} holds a block starting elsewhere"
            lengths = [len(self._ids[n]) for n in names]
            assert lengths == sorted(lengths, reverse=True), f"bucket {first} is not longest-first"


@dataclass(frozen=True)
class PathChoice:
    """Which skill blocks of a prompt are spliced, and the path the request takes because of it."""

    kept: list  # Matches spliced: after the prefix hit and at least min_tokens long
    skipped: list  # Matches after the hit left to the prefill (shorter than min_tokens)
    path: str  # composed | prefilled | cached (every block found is inside the prefix hit)
    reason: str


def choose_path(matches: Sequence[Match], hit: int, min_tokens: int) -> PathChoice:
    """Splice the blocks that end after the prefix hit and are long enough to pay for their repair
    (>= min_tokens); leave the shorter ones to the prefill, which computes them for less."""
    after = [m for m in matches if m.end > hit]
    kept = [m for m in after if m.end - m.start >= min_tokens]
    skipped = [m for m in after if m.end - m.start < min_tokens]

    def named(ms):
        return ", ".join(f"{m.name} ({m.end - m.start} tokens)" for m in ms)

    short = f"{named(skipped)} shorter than skill_min_tokens={min_tokens}, prefilled" if skipped else ""
    if kept:
        reason = f"spliced {named(kept)}" + (f"; {short}" if short else "")
        return PathChoice(kept, skipped, "composed", reason)
    if skipped:
        return PathChoice(kept, skipped, "prefilled", short)
    if matches:
        return PathChoice(kept, skipped, "cached", "the prefix cache holds every skill block of the prompt")
    return PathChoice(kept, skipped, "prefilled", "no skill block in the prompt")
