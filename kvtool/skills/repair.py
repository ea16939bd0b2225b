"""Repair strategies: how a block's KV is placed into a composed cache. A registry feeds the CLI.

Every strategy appends exactly len(block) tokens at cache.offset (so slot = position) and
returns PlaceStats; place() does one block. A strategy with leading(block) is placed in one pass:
compose_segments relocates every block, gives the token runs around them empty slots, and runs
the runs plus each block's leading() first tokens through the model together (each token
attends to everything before it, as a prefill would), so a context of four blocks after a
prefix costs one pass over the model instead of one per run. What each does, precisely:
- none: all tokens reuse the block's KV, keys rotated to the target positions (leading 0).
- recompute_first_k (k): the first k tokens are recomputed as a prefill would compute them (they
  attend to the real preceding context, so no false sink survives); tokens k.. reuse the rotated
  block KV. Within the pass each layer writes the fresh KV of all its tokens before they attend
  (causally, by position), so this equals doing it block by block, with a prefill of each run in
  between; on SmolLM2 one pass for 4 x 48 tokens took 419 ms where four passes took 560.
- recompute_deviation (ratio, layer): block by block. Place as `none`, then run all block tokens
  through layers 0..layer with the real context (their KV there becomes exact), rank tokens by
  |fresh - reused|^2 of K and V at `layer`, and run the top ceil(ratio * n) through the remaining
  layers, attending to the composed cache (CacheBlend-style selective recompute).
- recompute_attended (ratio, window, score): query-guided. Blocks are placed as `none` (with the
  runs before and between them, in one pass); the token run that follows the last block (the query)
  is prefilled once to measure the attention each block token receives from its last `window` tokens
  (all layers and heads; score attention_v weights each probability by the norm of the token's value
  in that head, what it adds to the attention output, attention takes the probability alone). The
  floor(ratio * n) most attended block tokens (n: all blocks before that run, ranked together) are
  recomputed through every layer in one pass, and the query with them, attending to the repaired
  cache (attention_v lowered the skills benchmark's KL at 10% in 3 of 4 model/preamble pairs, e.g.
  SmolLM2 deep blocks 0.0065 to 0.0051). It spends the recompute budget where the answer looks,
  at the cost of one extra query prefill; false sinks (the heavily attended first tokens of a
  block) are among what it picks. Without a token run after the blocks it recomputes nothing.
  Token runs between blocks keep the KV they got against unrepaired blocks.
  All layers score: on SmolLM2, ranking by the first half of the layers only (which could stop the
  measuring prefill halfway) more than doubled the next-token KL at 25% recomputed (0.032 vs 0.013).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from kvtool.errors import InvalidParameterError
from kvtool.kernels import rerotate
from kvtool.skill_settings import (NoRepairKnobs, RecomputeAttendedKnobs, RecomputeDeviationKnobs, RecomputeFirstKKnobs,
                                   parse_repair)


@dataclass
class PlaceStats:
    name: str
    start: int
    tokens: int
    recomputed: int = 0  # tokens run through every layer with the real context
    shared: int = 0  # tokens whose relocated KV an earlier placement at this position kept (read by reference)
    partial_layers: int = 0  # layers every block token was run through (recompute_deviation)
    ms: float = 0.0

    @property
    def reused(self) -> int:
        return self.tokens - self.recomputed


PLACEMENTS = 2  # positions a skill block keeps its relocated KV at, in pool blocks (SkillBlock.placed)


def append_relocated(runner, cache, block, share: bool = True) -> int:
    """Append the block's tokens at cache.offset, keys rotated from their canonical positions. In a paged cache the
    pool blocks they fill whole are kept per position (block.placed, the last PLACEMENTS): a later placement at that
    position reads them by reference instead of rotating and writing them (a write copies a shared block first).
    Returns the tokens read so (share: whether to keep or read such blocks)."""
    start, size = cache.offset, cache.block_size
    first, end = (-(-start // size) * size, (start + len(block)) // size * size) if size and share else (0, 0)
    delta = start - block.canonical_start

    def put(lo: int, hi: int) -> None:  # the block's tokens lo..hi-1
        cache.append_all(rerotate_layers(runner, block.keys[:, :, lo:hi], delta), block.values[:, :, lo:hi])

    if end <= first:
        put(0, len(block))
        return 0
    cache.reserve(start + len(block) + 1)
    key = (start, size, runner.dtype, str(runner.device))
    blocks = block.placed.pop(key, None)
    if blocks is None:
        put(0, len(block))
    else:
        put(0, first - start)
        cache.borrow(blocks)
        put(end - start, len(block))
    block.placed[key] = blocks or cache.lend(first // size, (end - first) // size)  # the newest last
    while len(block.placed) > PLACEMENTS:
        del block.placed[next(iter(block.placed))]
    return 0 if blocks is None else end - first


def rerotate_layers(runner, keys, delta: int):
    """keys [L, Hkv, T, D] moved by delta positions, each layer with its own RoPE base (Gemma 3 has two)."""
    groups = runner.rope_groups()
    if len(groups) == 1:
        return rerotate(keys.contiguous(), delta, groups[0][1])
    out = keys.new_empty(keys.shape)
    for layers, inv_freq in groups:
        out[layers] = rerotate(keys[layers].contiguous(), delta, inv_freq)
    return out


class NoRepair(NoRepairKnobs):
    def leading(self, block) -> int:
        return 0

    def place(self, runner, cache, block) -> PlaceStats:
        shared = append_relocated(runner, cache, block)
        return PlaceStats(block.name, cache.offset - len(block), len(block), shared=shared)


class RecomputeFirstK(RecomputeFirstKKnobs):
    def leading(self, block) -> int:
        return min(self.k, len(block))

    def place(self, runner, cache, block) -> PlaceStats:
        from kvtool.skills.selective import recompute_slots

        start, k = cache.offset, self.leading(block)
        shared = append_relocated(runner, cache, block)
        recompute_slots(runner, cache, list(range(start, start + k)), block.token_ids[:k])
        return PlaceStats(block.name, start, len(block), recomputed=k, shared=shared)


class RecomputeDeviation(RecomputeDeviationKnobs):
    def place(self, runner, cache, block) -> PlaceStats:
        from kvtool.skills.selective import recompute_selected

        if self.layer >= runner.spec.num_layers:  # before any KV is placed
            raise InvalidParameterError(f"{self.name}: layer {self.layer} does not exist; the model has "
                                        f"{runner.spec.num_layers} layers (0..{runner.spec.num_layers - 1})")
        start = cache.offset
        append_relocated(runner, cache, block, share=False)  # (its scoring pass writes every block token)
        result = recompute_selected(runner, cache, block.token_ids, start, float(self.ratio), self.layer,
                                    self.score, self.first)
        return PlaceStats(block.name, start, len(block), recomputed=len(result.selected),
                          partial_layers=self.layer + 1)


class RecomputeAttended(RecomputeAttendedKnobs):
    leading, place = NoRepair.leading, NoRepair.place  # blocks go in as-is; the repair happens in repair_run

    def repair_run(self, runner, cache, placed: list, ids: list[int], chunk: int, logits: str):
        """placed: (PlaceStats, block) of the blocks before the query `ids`, which come next in `cache`.
        Recomputes the most attended block tokens and the query over them in one pass; the query's logits."""
        from kvtool.skills.selective import recompute_most_attended

        slots = [s for p, _ in placed for s in range(p.start, p.start + p.tokens)]
        token_at = {p.start + i: t for p, block in placed for i, t in enumerate(block.token_ids)}
        chosen, logits_out = recompute_most_attended(runner, cache, slots, token_at, ids, int(self.ratio * len(slots)),
                                                     self.window, chunk, logits, values=self.score == "attention_v")
        for p, _ in placed:
            p.recomputed = sum(p.start <= s < p.start + p.tokens for s in chosen)
        return logits_out


REPAIRS: dict[str, type] = {cls.name: cls for cls in (NoRepair, RecomputeFirstK, RecomputeDeviation,
                                                      RecomputeAttended)}


def is_query_guided(repair) -> bool:
    """True for a repair that needs the token run after the blocks (compose_segments calls its repair_run)."""
    return getattr(repair, "query_guided", False)


def make_repair(spec="none", **knobs):
    """A repair from an instance, a name plus knobs, or a CLI string 'name' / 'name:knob=value,knob=value'."""
    return parse_repair(spec, REPAIRS, **knobs)


def describe(repair) -> str:
    knobs = ",".join(f"{f.name}={getattr(repair, f.name)}" for f in fields(repair))
    return f"{repair.name}:{knobs}" if knobs else repair.name

