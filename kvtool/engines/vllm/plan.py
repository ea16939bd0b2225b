"""What the connector supplies for one request: pure Python over token ids (no torch, no vLLM).

vLLM hands the connector a request with `local` tokens already in its own prefix cache. The connector may
supply the next contiguous run [local, ready): tokens the saved prefix cache (the --cache-file store) holds,
then composed skill blocks and the text between them. vLLM prefills [ready, len) itself, and always at least
the prompt's last token (it needs that token's logits).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from kvtool.skills.match import choose_path


@dataclass
class Plan:
    local: int  # tokens vLLM's prefix cache already holds
    stored: int  # tokens the kvtool store holds (0 without a --cache-file store); used when > local
    cut: int  # composition starts here: the store / local hit, or the start of a block that straddles it
    ready: int  # the connector supplies [local, ready)
    segments: list = field(default_factory=list)  # ("ids", [...]) or ("block", name), covering [cut, ...)
    path: str = "prefill"  # splice | stored | prefill (nothing supplied)
    skipped: list[str] = field(default_factory=list)  # blocks found but too short to pay for splicing
    skill_path: str = "prefilled"  # what the response's timings report (kvtool.skills.match.choose_path)
    skill_reason: str = ""

    @property
    def supplied(self) -> int:
        return self.ready - self.local

    @property
    def block_names(self) -> list[str]:
        return [name for kind, name in self.segments if kind == "block"]


def plan_request(prompt: Sequence[int], local: int, stored: int, find: Callable, min_block_tokens: int = 0,
                 query_guided: bool = False) -> Plan:
    """find(prompt) -> [Match(name, start, end)] of skill blocks (leftmost, non-overlapping). Blocks shorter than
    min_block_tokens are left to the prefill (splicing them costs more than it saves). A query-guided repair
    needs the text after the last block, so the plan then runs to the prompt's last token."""
    n = len(prompt)
    hit = max(local, stored)
    choice = choose_path(find(prompt), hit, min_block_tokens)
    found, skipped = choice.kept, [m.name for m in choice.skipped]
    limit = n - 1  # vLLM computes at least the last prompt token
    if not found:
        ready = min(hit, limit)
        return Plan(local, stored, ready, ready, [], "stored" if ready > local else "prefill", skipped,
                    choice.path, choice.reason)
    cut = min(hit, found[0].start)
    segments, pos = [], cut
    for m in found:
        if m.start > pos:
            segments.append(("ids", list(prompt[pos:m.start])))
        segments.append(("block", m.name))
        pos = m.end
    if query_guided and pos < limit:
        segments.append(("ids", list(prompt[pos:limit])))
        pos = limit
    ready = min(pos, limit)
    if ready <= local:  # everything the blocks would supply is in vLLM's cache already
        return Plan(local, stored, local, local, [], "prefill", skipped, "cached",
                    "vLLM's prefix cache holds every skill block of the prompt")
    return Plan(local, stored, cut, ready, segments, "splice", skipped, choice.path, choice.reason)
