"""compose(): build a cache for [prefix][block A][block B]...[suffix] without prefilling the blocks.

Token runs are prefilled normally; each block is placed at the next free position by a repair
strategy (kvtool.skills.repair), which rotates its keys there and recomputes what it chooses. A
repair with place_all (recompute_first_k) gets the blocks and the token runs between them together
and computes those runs in its own pass. A query-guided repair (recompute_attended) also gets the
last token run after the blocks, the query: it repairs the blocks by what that run attends to, then
prefills it.
The cache stays position-aligned (slot i holds position i), so anything appended later,
prefill or decode, continues at the right positions.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence, Union

import torch

from kvtool.cache.kv import KVCache
from kvtool.config import EngineConfig
from kvtool.engine.ids import as_token_ids
from kvtool.errors import ContextWindowError, InvalidParameterError
from kvtool.skills.block import SkillBlock
from kvtool.skills.repair import PlaceStats, is_query_guided, make_repair

Segment = Union[Sequence[int], SkillBlock]
LOGITS = ("last", "all", "none")  # which logits of the last token run come back


@dataclass
class Composition:
    cache: KVCache
    logits: torch.Tensor | None  # of the last token when the last segment is a token run
    placements: list[PlaceStats] = field(default_factory=list)
    prefilled_tokens: int = 0  # token-run tokens prefilled (recomputed block tokens not included)
    ms: float = 0.0

    @property
    def block_tokens(self) -> int:
        return sum(p.tokens for p in self.placements)

    @property
    def recomputed_tokens(self) -> int:
        return sum(p.recomputed for p in self.placements)

    @property
    def reused_tokens(self) -> int:
        return self.block_tokens - self.recomputed_tokens

    def stats(self) -> dict:
        return {"block_tokens": self.block_tokens, "reused_block_tokens": self.reused_tokens,
                "recomputed_block_tokens": self.recomputed_tokens, "prefilled_tokens": self.prefilled_tokens,
                "blocks": [{"name": p.name, "start": p.start, "tokens": p.tokens, "recomputed": p.recomputed}
                           for p in self.placements], "compose_ms": round(self.ms, 3)}


def check_fits(runner, start: int, segments: Sequence[Segment]) -> int:
    """Total length; ContextWindowError if any target position falls outside the context window."""
    total, window = start + sum(len(s) for s in segments), runner.spec.max_position
    if total > window:
        pos, where = start, ""
        for seg in segments:
            if isinstance(seg, SkillBlock) and pos + len(seg) > window:
                where = f"; skill block {seg.name!r} would occupy positions {pos}..{pos + len(seg) - 1}"
                break
            pos += len(seg)
        raise ContextWindowError(f"the composed context has {total} tokens but the model's context window is "
                                 f"{window} positions{where}; use fewer or shorter blocks")
    return total


def compose_segments(runner, segments: Sequence[Segment], repair="none", cache: KVCache | None = None,
                     logits: str = "last", chunk: int = EngineConfig.prefill_chunk) -> Composition:
    """Append segments to `cache` (a new one by default); token runs are prefilled, blocks placed."""
    runner = getattr(runner, "runner", runner)
    repair = make_repair(repair)
    if logits not in LOGITS:
        raise InvalidParameterError(f"logits must be one of {', '.join(LOGITS)}, got {logits!r}")
    segments = [seg if isinstance(seg, SkillBlock) else as_token_ids(seg, f"segment {i} (a token run)")
                for i, seg in enumerate(segments)]
    t0 = time.perf_counter()
    start = cache.offset if cache is not None else 0
    total = check_fits(runner, start, segments)
    for seg in segments:
        if isinstance(seg, SkillBlock):
            seg.check_runner(runner)
    if cache is None:
        cache = runner.new_cache(total + 1)
    cache.reserve(total + 1)
    out = Composition(cache, None)
    batch: list = []  # blocks and the token runs between them, for a repair that places them together
    at = [i for i, seg in enumerate(segments) if isinstance(seg, SkillBlock)]
    between = {i for i in range(at[0] + 1, at[-1]) if not isinstance(segments[i], SkillBlock)} if at else set()
    guided = is_query_guided(repair)
    placed: list[tuple[PlaceStats, SkillBlock]] = []  # for a query-guided repair: the blocks so far
    runs = [i for i, seg in enumerate(segments) if not isinstance(seg, SkillBlock) and len(seg)]
    query_run = runs[-1] if guided and runs and any(isinstance(s, SkillBlock) for s in segments[:runs[-1]]) else -1

    def place_batch():
        if batch:
            items = [b.to(runner.device) if isinstance(b, SkillBlock) else b for b in batch]
            out.placements.extend(repair.place_all(runner, cache, items))
            batch.clear()

    for i, seg in enumerate(segments):
        if isinstance(seg, SkillBlock):
            if hasattr(repair, "place_all"):
                batch.append(seg)
            else:
                block = seg.to(runner.device)
                out.placements.append(repair.place(runner, cache, block))
                if guided:
                    placed.append((out.placements[-1], block))
            out.logits = None
        elif len(seg) and i in between and hasattr(repair, "place_all"):
            batch.append(list(seg))
            out.prefilled_tokens += len(seg)
        elif len(seg):
            place_batch()
            if i == query_run:
                out.logits = repair.repair_run(runner, cache, placed, list(seg), chunk, logits)
            else:
                out.logits = runner.prefill(list(seg), cache, chunk=chunk, logits=logits)
            out.prefilled_tokens += len(seg)
    place_batch()
    out.ms = (time.perf_counter() - t0) * 1000.0
    return out


def compose(runner, prefix_tokens: Sequence[int], blocks: Sequence[SkillBlock], suffix_tokens: Sequence[int],
            repair="none", logits: str = "last", chunk: int = EngineConfig.prefill_chunk) -> Composition:
    """Cache for [prefix][blocks...][suffix]; `logits` of the suffix's last token ("all": every suffix token)."""
    if isinstance(blocks, SkillBlock) or not isinstance(blocks, Sequence):
        raise InvalidParameterError(f"blocks must be a list of SkillBlocks (a single block in a list too); got "
                                    f"{type(blocks).__name__}")
    for i, block in enumerate(blocks):
        if not isinstance(block, SkillBlock):
            raise InvalidParameterError(f"blocks[{i}] is a {type(block).__name__}, not a SkillBlock "
                                        "(catalog.block(name) or load_block(path) gives one)")
    prefix_tokens, suffix_tokens = as_token_ids(prefix_tokens, "prefix_tokens"), as_token_ids(suffix_tokens,
                                                                                               "suffix_tokens")
    return compose_segments(runner, [list(prefix_tokens), *blocks, list(suffix_tokens)], repair, logits=logits,
                            chunk=chunk)
