"""compose(): build a cache for [prefix][block A][block B]...[suffix] without prefilling the blocks.

Each block is placed at the next free position by a repair strategy (kvtool.skills.repair), which
rotates its keys there and recomputes what it chooses. For a strategy placed in one pass (none,
recompute_first_k, recompute_attended: those with leading()), every block is relocated, every
token run gets empty slots, and one pass over the model computes the runs and the blocks' leading
tokens, each attending to everything before it: the same KV as prefilling run by run, without a
pass over the weights per run (a skill-loading conversation has a run before and after every
block). A query-guided repair (recompute_attended) takes the last token run after the blocks, the
query, out of that pass: it repairs the blocks by what that run attends to, then computes it again
over the repaired blocks.
Other strategies (recompute_deviation) go segment by segment, runs prefilled as usual.
The cache stays position-aligned (slot i holds position i), so anything appended later,
prefill or decode, continues at the right positions.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Sequence, Union

import torch

from kvtool.cache.kv import KVCache
from kvtool.config import EngineConfig, is_whole
from kvtool.errors import ContextWindowError, InvalidParameterError
from kvtool.ids import as_token_ids
from kvtool.skills.block import SkillBlock
from kvtool.skills.repair import PlaceStats, append_relocated, is_query_guided, make_repair
from kvtool.skills.selective import append_empty, recompute_slots



class SkillWindowWarning(UserWarning):
    """A composed skill block lies (partly) beyond the sliding-window layers' reach; the global layers see it."""


Segment = Union[Sequence[int], SkillBlock]
LOGITS = ("last", "all", "none")  # which logits of the last token run come back


@dataclass
class Composition:
    cache: KVCache
    logits: torch.Tensor | None  # of the last token when the last segment is a token run
    placements: list[PlaceStats] = field(default_factory=list)
    prefilled_tokens: int = 0  # token-run tokens prefilled (recomputed block tokens not included)
    ms: float = 0.0
    notes: list[str] = field(default_factory=list)  # what the composition could not give (out_of_window)

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
                "blocks": [{"name": p.name, "start": p.start, "tokens": p.tokens, "recomputed": p.recomputed,
                            "shared": p.shared}
                           for p in self.placements], "compose_ms": round(self.ms, 3), "notes": self.notes}


def out_of_window(spec, placements: list[PlaceStats], last: int) -> list[str]:
    """Sliding-window layers show the token at slot `last` only the window before it: a block that ends
    before that reaches it through the global layers alone; say so for each such block."""
    window, local = spec.sliding_window, spec.sliding_layers
    notes = []
    for p in placements if window else []:
        end = p.start + p.tokens  # one past the block's last slot
        if last - (end - 1) >= window:
            notes.append(f"skill block {p.name!r} ends {last - end + 1} tokens before the last token, beyond the "
                         f"{window}-token window of the {len(local)} sliding-window layers: only the "
                         f"{spec.num_layers - len(local)} global layers attend to it")
        elif last - p.start >= window:
            notes.append(f"skill block {p.name!r} starts {last - p.start} tokens before the last token: its first "
                         f"{last - p.start - window + 1} tokens are beyond the {window}-token window of the "
                         f"{len(local)} sliding-window layers, which do not attend to them")
    return notes


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
    """Append segments to `cache` (a new one by default); token runs are prefilled, blocks placed.
    `logits` are those of the last segment when it is a token run (else None)."""
    runner = getattr(runner, "runner", runner)
    repair = make_repair(repair)
    if logits not in LOGITS:
        raise InvalidParameterError(f"logits must be one of {', '.join(LOGITS)}, got {logits!r}")
    segments = [seg if isinstance(seg, SkillBlock) else as_token_ids(seg, f"segment {i} (a token run)")
                for i, seg in enumerate(segments)]
    if not is_whole(chunk, 1):
        raise InvalidParameterError(f"chunk must be an integer >= 1 tokens, got {chunk!r}")
    t0 = time.perf_counter()
    start = cache.offset if cache is not None else 0
    total = check_fits(runner, start, segments)
    for seg in segments:
        if isinstance(seg, SkillBlock):
            seg.check_runner(runner)
        else:
            runner.check_ids(torch.as_tensor(seg, dtype=torch.long))
    if cache is None:
        cache = runner.new_cache(total + 1)
    cache.reserve(total + 1)
    out = Composition(cache, None)
    segments = [seg for seg in segments if len(seg)]  # token runs are lists already (as_token_ids)
    is_block = [isinstance(seg, SkillBlock) for seg in segments]
    runs = [i for i, b in enumerate(is_block) if not b]
    query = runs[-1] if is_query_guided(repair) and runs and any(is_block[:runs[-1]]) else len(segments)
    place = _one_pass if any(is_block) and hasattr(repair, "leading") else _one_by_one
    out.logits = place(runner, cache, segments[:query], repair, out, chunk, logits)
    if query < len(segments):  # repair_run repairs the blocks by what the query attends to, and computes it
        placed = list(zip(out.placements, [seg for seg in segments[:query] if isinstance(seg, SkillBlock)]))
        out.logits = repair.repair_run(runner, cache, placed, segments[query], chunk, logits)
        out.prefilled_tokens += len(segments[query])
        if segments[query + 1:]:
            out.logits = place(runner, cache, segments[query + 1:], repair, out, chunk, logits)
    out.ms = (time.perf_counter() - t0) * 1000.0
    out.notes = out_of_window(runner.spec, out.placements, cache.offset - 1)
    for note in out.notes:
        warnings.warn(note, SkillWindowWarning, stacklevel=2)
    return out


def _one_by_one(runner, cache, segments, repair, out: Composition, chunk: int, logits: str):
    """Segment by segment: runs prefilled, blocks placed; the logits of the last segment if it is a run."""
    found = None
    for seg in segments:
        if isinstance(seg, SkillBlock):
            out.placements.append(repair.place(runner, cache, seg.to(runner.device)))
            found = None
        else:
            found = runner.prefill(seg, cache, chunk=chunk, logits=logits)
            out.prefilled_tokens += len(seg)
    return found


def _one_pass(runner, cache, segments, repair, out: Composition, chunk: int, logits: str):
    """Blocks relocated and runs given empty slots, then one pass (in `chunk`-token parts) over the runs and
    each block's repair.leading() first tokens; the logits of the last segment if it is a run."""
    slots, ids = [], []
    for seg in segments:
        at = cache.offset
        if isinstance(seg, SkillBlock):
            block = seg.to(runner.device)
            take = block.token_ids[: repair.leading(block)]
            shared = append_relocated(runner, cache, block)
            out.placements.append(PlaceStats(block.name, at, len(block), recomputed=len(take), shared=shared))
        else:  # the pass writes every layer's K/V here before anything reads it
            take = seg
            append_empty(runner, cache, len(seg))
            out.prefilled_tokens += len(seg)
        slots += range(at, at + len(take))
        ids += take
    last = segments[-1] if segments else None
    rows = 0 if last is None or isinstance(last, SkillBlock) or logits == "none" else \
        len(last) if logits == "all" else 1
    return recompute_slots(runner, cache, slots, ids, chunk=chunk, rows=rows)


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
