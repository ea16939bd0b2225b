"""The step executor: runs a scheduler's Plan (kvtool.engine.scheduler) on the engine's model and draws its tokens.

One runner.run(ForwardPlan) per step over every planned chunk, on the engine's choice of forward
(EngineConfig.forward): each chunk's last-token logits [1, V], or every token's [T, V] for a prompt being scored
(its PromptScorer takes the rows, and the last one is kept). Then every request that samples in the step (its
chunk ends its pending tokens, or it starts from a shared prompt's logits) draws its next token. Those without a
seed draw together (kvtool.engine.batch_sampling): one pass over their stacked logits, each row with its own
parameters, and one host read for all tokens and logprobs. A seeded request draws from its own generator, alone, so
its output repeats exactly as in a single stream; where its sampler raises, the exception takes the place of its
Sample, and the scheduler ends that request alone.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import torch

from kvtool.engine.batch_sampling import batchable, sample_rows
from kvtool.engine.sampling import Sample
from kvtool.engine.plan import BatchRequest, Plan
from kvtool.models.layers import ForwardPlan


class Executed(NamedTuple):
    logits: list[torch.Tensor]  # per plan chunk: its last token's [1, V]
    samples: dict[BatchRequest, Sample | Exception]  # the next token of each request that samples (or its fault)
    seconds: float  # spent in the forward and the token reads: the rest of a step is host time


class StepExecutor:
    """Runs plans on an engine's runner (engine: kvtool.engine.engine.Engine, read at each step)."""

    def __init__(self, engine):
        self.engine = engine

    def run(self, plan: Plan) -> Executed:
        t0 = time.perf_counter()
        modes = [("all" if c.req.scorer is not None else "last") for c in plan.chunks]
        step = ForwardPlan([(c.tokens, c.req.cache) for c in plan.chunks], logits=modes if "all" in modes else "last",
                           path=self.engine.config.forward)
        logits = self.engine.runner.run(step) if plan.chunks else []
        for j, chunk in enumerate(plan.chunks):
            if chunk.req.scorer is not None:  # every row of a scored chunk: reduced now, the last one kept
                chunk.req.scorer.add(logits[j])
                logits[j] = logits[j][-1:]
        rows = [(c.req, out) for c, out in zip(plan.chunks, logits) if c.samples] + plan.given
        return Executed(logits, sample(rows), time.perf_counter() - t0)

def sample(rows: list[tuple[BatchRequest, torch.Tensor]]) -> dict[BatchRequest, Sample | Exception]:
    """The next token of each (request, logits [1, V]) row: the unseeded ones in one batched pass and one host read,
    each seeded one with its own sampler (its exception in place of a Sample where it raises)."""
    out: dict[BatchRequest, Sample | Exception] = {}
    together = [(req, logits) for req, logits in rows if batchable(req.state.sampler)]
    if together:
        parts = [logits.reshape(1, -1) for _, logits in together]
        stacked = torch.cat(parts) if len(parts) > 1 else parts[0]
        out.update(zip([req for req, _ in together], sample_rows([r.state.sampler for r, _ in together], stacked)))
    for req, logits in rows:
        if req not in out:
            try:
                out[req] = req.state.sampler(logits)
            except Exception as exc:  # this request alone fails
                out[req] = exc
    return out
