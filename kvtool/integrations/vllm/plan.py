"""What the connector supplies for one request: pure Python over token ids (no torch, no vLLM).

vLLM hands the connector a request with `local` tokens already in its own prefix cache. The connector may supply
one contiguous run [local, ready) and vLLM's forward computes the rest [ready, len), always at least the prompt's
last token (it needs that token's logits). The connector computes nothing itself, so the run is built only from KV
that exists already:
- "store": whole blocks of the prompt's prefix in the shared block store (kvtool.cache.kvstore), from any server;
- "tail": the partial block before the first skill block, as a server saved it after computing that prefix (the
  shared system prompt of every request ends mid-block, and this closes the seam);
- "block": a compiled skill block, its keys re-rotated to where it lands.
Text between blocks has no KV before vLLM computes it: the run ends there and the blocks after it are prefilled.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from kvtool.skills.match import choose_path


@dataclass(frozen=True)
class Piece:
    kind: str  # store | tail | block
    start: int  # prompt positions [start, end) it supplies
    end: int
    name: str = ""  # the block's name
    at: int = 0  # where the block's first token sits in the prompt (start - at of its tokens are vLLM's already)


@dataclass
class Plan:
    local: int  # tokens vLLM's prefix cache already holds
    stored: int  # whole-block tokens the store holds from position 0
    ready: int  # the connector supplies [local, ready)
    pieces: list[Piece] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # blocks found but too short to pay for splicing
    prefilled: list[str] = field(default_factory=list)  # blocks after text the connector has no KV for
    skill_path: str = "prefilled"  # composed | prefilled | cached (kvtool.skills.match.choose_path)
    skill_reason: str = ""
    tail_at: int | None = None  # where the first block starts (its prefix's partial block is worth saving)

    @property
    def supplied(self) -> int:
        return self.ready - self.local

    @property
    def block_names(self) -> list[str]:
        return [p.name for p in self.pieces if p.kind == "block"]

    @property
    def block_tokens(self) -> int:
        return sum(p.end - p.start for p in self.pieces if p.kind == "block")

    @property
    def path(self) -> str:
        return "splice" if self.block_names else "stored" if self.ready > self.local else "prefill"


def plan_request(prompt: Sequence[int], local: int, stored: int, find: Callable, block_size: int,
                 has_tail: Callable[[int, int], bool] = lambda start, end: False, min_block_tokens: int = 0) -> Plan:
    """find(prompt) -> [Match(name, start, end)] of skill blocks (leftmost, non-overlapping); has_tail(start, end):
    whether the store holds the KV of prompt[start:end] after the whole blocks before `start`. Blocks shorter than
    min_block_tokens are left to the prefill (splicing them costs more than it saves)."""
    limit = len(prompt) - 1  # vLLM computes at least the last prompt token
    hit = min(max(local, stored), limit)
    found = find(prompt)
    choice = choose_path(found, hit, min_block_tokens)
    if choice.kept and local <= (at := choice.kept[0].start) < hit:  # the store's hit reaches into the first block:
        cut = max(local, at // block_size * block_size)  # splice it whole from its start, as kvtool's engine does
        if cut == at or has_tail(cut, at):
            hit = cut
    plan = Plan(local, stored, hit, [], [m.name for m in choice.skipped], [], choice.path, choice.reason,
                found[0].start if found else None)
    if hit > local:
        plan.pieces.append(Piece("store", local, hit))
    pos = hit
    for i, m in enumerate(choice.kept):
        if m.start > pos:  # text before the block: only a saved tail of the prefix's last block covers it
            if pos % block_size or m.start - pos >= block_size or not has_tail(pos, m.start):
                plan.prefilled = [k.name for k in choice.kept[i:]]
                break
            plan.pieces.append(Piece("tail", pos, m.start))
            pos = m.start
        end = min(m.end, limit)
        if end > pos:
            plan.pieces.append(Piece("block", pos, end, m.name, m.start))
        pos = m.end
        if pos >= limit:
            break
    plan.ready = min(pos, limit)
    if plan.ready <= local:
        plan.ready, plan.pieces = local, []
    _describe(plan, found)
    return plan


def _describe(plan: Plan, found: list) -> None:
    """What the response's timings report: composed when a block was supplied, else why not."""
    if plan.block_names:
        plan.skill_path = "composed"
        if plan.prefilled:
            plan.skill_reason += (f"; {', '.join(plan.prefilled)} prefilled by vLLM (text before "
                                  f"{plan.prefilled[0]} has no KV until vLLM computes it)")
    elif plan.prefilled:
        plan.skill_path = "prefilled"
        plan.skill_reason = (f"the text before {plan.prefilled[0]} has no KV until vLLM computes it; "
                             f"{', '.join(plan.prefilled)} prefilled")
    elif found and plan.skill_path == "composed":  # every block sits in what vLLM's cache or the store holds
        plan.skill_path, plan.skill_reason = "cached", "vLLM's prefix cache or the store holds every skill block"
