"""The n choices of one prompt: their seeds, their order, and the Fork through which they share its prefill.

Requests added to a BatchScheduler with one Fork prefill their prompt once: the first prefills it; the
others wait, and when its prefill ends each starts from a copy of its prompt KV (with a prefix cache on the
C++ CPU path, one that reads the prompt's cached blocks in place and owns only the tokens after them) and
draws its first token from the same last-prompt-token logits with its own sampler. If the first ends before
its prefill does, the others prefill on their own. The copy waiting for them counts against the KV budget;
under KV pressure it is dropped before any running request is preempted, and the others prefill on their
own (from the prefix cache, where the first published the prompt).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kvtool.cache.kv import KVCache
from kvtool.config import SamplingParams


def choice_seed(seed: int | None, i: int) -> int | None:
    """Choice i of a seeded request draws with seed + i (wrapped into torch's seed range)."""
    return None if seed is None else (seed + i if seed + i < 2**64 else seed + i - 2**64)


def choices(prompts: list[list[int]], params: list[SamplingParams], n: int):
    """(ids, params, fork) of choice i of prompt p, in the order p * n + i: choice i seeded seed + i, the
    choices of one prompt sharing a Fork (none for a single choice)."""
    for ids, p in zip(prompts, params):
        fork = Fork() if n > 1 else None
        for i in range(n):
            yield ids, (replace(p, seed=choice_seed(p.seed, i)) if i else p), fork


@dataclass(eq=False)
class Fork:
    """A prompt shared by sibling requests: its KV and last-token logits once the first has prefilled it."""
    leader: object = None  # the first kvtool.engine.scheduler.BatchRequest added with this fork: it prefills the prompt
    cache: KVCache | None = None
    logits: torch.Tensor | None = None
    handle: object = None  # the copy's hold on the prefix cache's blocks it reads (PrefixCache.fork)
    abandoned: bool = False  # the leader ended before its prefill did: the others prefill on their own
