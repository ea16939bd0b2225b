"""KV memory under pressure: which request is preempted, and (tests further down) the engine's one block pool,
which never hands out a block beyond its size."""

import pytest

from kvtool import SamplingParams
from kvtool.config import EngineConfig
from kvtool.engine import Engine
from kvtool.engine.scheduler import BatchScheduler
from tests.cache.test_manager import model as tiny, rand_ids  # noqa: F401 (a module-scoped fixture: tiny Qwen3)

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def test_the_newest_of_requests_admitted_in_one_step_is_preempted_first(tiny):
    """Three prompts start in one step and fit the budget until they decode together: the last admitted goes."""
    engine = Engine(tiny, EngineConfig(prefill_chunk=64))
    prompts = [rand_ids(n, n) for n in (10, 12, 14)]
    want = [engine.generate(p, GREEDY).run().token_ids for p in prompts]
    sched = BatchScheduler(engine, max_running=4, prefill_budget=64, kv_budget_tokens=sum(map(len, prompts)) + 1)
    gens = [sched.submit(p, GREEDY) for p in prompts]
    first = sched.schedule()
    assert [c.req.gen for c in first.chunks] == gens and len({c.req.admitted_at for c in first.chunks}) == 1
    sched.postprocess(first, *engine.executor.run(first)[:2])
    preempted = []
    while not sched.idle:
        plan = sched.schedule()
        preempted += [r.gen for r in plan.preempted]
        sched.postprocess(plan, *engine.executor.run(plan)[:2])
    assert preempted[0] is gens[2] and gens[0] not in preempted
    assert [g.token_ids for g in gens] == want
