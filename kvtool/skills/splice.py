"""SkillSplicer: the Engine's prefix_cache hook that splices skill blocks found in a prompt.

prepare(prompt_ids, runner) -> (cache, n_ready, handle): the cache holds exactly the first
n_ready prompt tokens: the inner hook's prefix hit (if any), then for every block found after it
the gap before it (prefilled) and the block (placed by the repair strategy); n_ready ends at the
last block, and the engine prefills the rest. A query-guided repair (recompute_attended) repairs the
blocks by what the rest of the prompt attends to, so prepare() prefills that too, all but the last
token, which the engine prefills. commit() and publish() pass through to the inner hook, so a
conversation's next turn reuses the composed KV as an ordinary prefix hit (composition is causal:
the KV of a token prefix does not depend on what follows it).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from kvtool.cache.hook import PrefixHook
from kvtool.skills.catalog import SkillCatalog
from kvtool.skills.compose import compose_segments
from kvtool.skills.match import choose_path
from kvtool.skills.repair import describe, is_query_guided, make_repair


@dataclass
class SpliceStats:
    prompt_tokens: int = 0
    prefix_hit_tokens: int = 0  # served by the inner hook (prefix cache)
    block_tokens: int = 0  # covered by skill blocks (reused + recomputed)
    recomputed_block_tokens: int = 0  # of those, recomputed by the repair
    gap_tokens: int = 0  # prefilled by prepare() before/between blocks (and after them for a query-guided repair)
    ready_tokens: int = 0  # n_ready handed to the engine
    blocks: list[dict] = field(default_factory=list)  # name, start, tokens, recomputed
    repair: str = "none"
    ms: float = 0.0
    path: str = "prefilled"  # composed | prefilled | cached (kvtool.skills.match.choose_path)
    path_reason: str = ""

    @property
    def reused_block_tokens(self) -> int:
        return self.block_tokens - self.recomputed_block_tokens

    def to_dict(self) -> dict:
        return {**asdict(self), "reused_block_tokens": self.reused_block_tokens}


@dataclass
class SpliceHandle:
    inner: Any
    stats: SpliceStats

    @property
    def block_tokens(self) -> int:
        return self.stats.block_tokens


class SkillSplicer(PrefixHook):
    """Wraps an optional inner hook (the prefix cache) and splices catalog blocks after its hit."""

    def __init__(self, catalog: SkillCatalog, repair="none", inner=None, chunk: int = 512, min_tokens: int = 0):
        """min_tokens: blocks shorter than this are left in the prompt for the prefill (splicing costs more)."""
        self.catalog, self.min_tokens = catalog, min_tokens
        self.repair = make_repair(repair)
        self.inner = inner
        self.chunk = chunk
        self.last_stats: SpliceStats | None = None  # of the latest prepare(); each handle keeps its own

    def prepare(self, prompt_ids: list[int], runner):
        t0 = time.perf_counter()
        stats = SpliceStats(prompt_tokens=len(prompt_ids), repair=describe(self.repair))
        if self.inner is not None:
            cache, hit, inner_handle = self.inner.prepare(prompt_ids, runner)
        else:
            cache, hit, inner_handle = runner.new_cache(len(prompt_ids) + 64), 0, None
        matches = self.catalog.find(prompt_ids)
        choice = choose_path([m for m, _ in matches], hit, self.min_tokens)
        stats.path, stats.path_reason = choice.path, choice.reason
        found = [(m, b) for m, b in matches if m in choice.kept]
        if found and found[0][0].start < hit:
            hit = found[0][0].start  # the hit ends inside a block: splice the whole block instead
        if found:
            cache.truncate(hit)
        stats.prefix_hit_tokens = hit
        if found:
            segments, pos = [], hit
            for match, block in found:
                segments += [prompt_ids[pos:match.start], block]
                pos = match.end
            if is_query_guided(self.repair) and pos < len(prompt_ids) - 1:
                segments.append(prompt_ids[pos:-1])  # the repair needs the query; the engine prefills the last token
                pos = len(prompt_ids) - 1
            done = compose_segments(runner, segments, self.repair, cache=cache, logits="none", chunk=self.chunk)
            stats.block_tokens, stats.recomputed_block_tokens = done.block_tokens, done.recomputed_tokens
            stats.gap_tokens = done.prefilled_tokens
            stats.blocks = done.stats()["blocks"]
            hit = pos
        stats.ready_tokens = hit
        stats.ms = (time.perf_counter() - t0) * 1000.0
        self.last_stats = stats
        return cache, hit, SpliceHandle(inner_handle, stats)

    def commit(self, handle: SpliceHandle | None, token_ids: list[int], cache) -> None:
        """handle None: a request that holds none (an n > 1 sibling starts from its leader's KV)."""
        if self.inner is not None and handle is not None:
            self.inner.commit(handle.inner, token_ids, cache)

    def publish(self, handle: SpliceHandle | None, token_ids: list[int], cache) -> None:
        if self.inner is not None and handle is not None:
            self.inner.publish(handle.inner, token_ids, cache)

    def splice_stats(self, handle: SpliceHandle | None) -> SpliceStats | None:
        return None if handle is None else handle.stats
