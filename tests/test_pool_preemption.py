"""KV memory under pressure: which request is preempted, and (tests further down) the engine's one block pool,
which never hands out a block beyond its size."""

import re

import pytest

from kvtool import SamplingParams
from kvtool.cache.manager import attach_prefix_cache
from kvtool.cache.store import BlockPool
from kvtool.config import EngineConfig
from kvtool.engine import Engine
from kvtool.engine.scheduler import BatchScheduler
from kvtool.errors import PoolExhausted
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


def pool_blocks(model, n, size):
    """Bytes of n KV blocks of `size` tokens for this model (an Engine's pool then holds exactly n)."""
    return n * size * model.runner.spec.kv_bytes_per_token(model.runner.dtype.itemsize)


@pytest.fixture
def allocations(monkeypatch):
    """Every block a pool hands out, as (the pool, whether the block lies in the pool's one allocation)."""
    taken, take = [], BlockPool.take

    def spy(pool):
        block = take(pool)
        base = pool._pool.untyped_storage().data_ptr() if pool._pool is not None else None
        taken.append((pool, block.untyped_storage().data_ptr() == base))
        return block

    monkeypatch.setattr(BlockPool, "take", spy)
    return taken


def run_crowded(model, size, kv_blocks, prompts, params, cache_blocks=None):
    """Every prompt at once through an engine whose pool holds kv_blocks (+ cache_blocks, with a prefix cache):
    (the Generations, the scheduler, the engine)."""
    engine = Engine(model, EngineConfig(prefill_chunk=64, prefix_block=size, kv_bytes=pool_blocks(model, kv_blocks, size),
                                        cache_bytes=pool_blocks(model, cache_blocks or 0, size)))
    cache = attach_prefix_cache(engine, pool_blocks(model, cache_blocks, size), size) if cache_blocks else None
    assert engine.pool.blocks == kv_blocks + (cache_blocks or 0) and engine.scheduler.kv_budget_tokens == \
        engine.pool.blocks * size  # the pool is the one count: no token cap beside it
    gens = [engine.scheduler.submit(p, params) for p in prompts]
    engine.scheduler.run()
    if cache is not None:
        cache.check_integrity()
    return gens, engine.scheduler, engine


def test_a_small_pool_never_allocates_outside_and_preempted_requests_end_with_the_same_tokens(tiny, allocations):
    """Six requests that need about 8 blocks each, on a pool of 12 (then 12 + 8 for a prefix cache): blocks come
    from the one allocation only, the newest are preempted and recomputed, and the greedy tokens are those of a
    large pool. With the prefix cache the shared first 16 tokens are hits, and its blocks are evicted for room."""
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    shared = rand_ids(16, 7)
    prompts = [rand_ids(n, n) for n in (10, 14, 18, 20)] + [shared + rand_ids(3, 1), shared + rand_ids(4, 2)]
    want = [g.token_ids for g in Engine(tiny, EngineConfig(prefill_chunk=64)).generate_batch(prompts, greedy)]
    for cache_blocks in (None, 8):
        allocations.clear()
        gens, sched, engine = run_crowded(tiny, 4, 12, prompts, greedy, cache_blocks)
        assert [g.token_ids for g in gens] == want and {g.finish_reason for g in gens} == {"length"}
        assert sched.preemptions > 0 and allocations and all(inside for _, inside in allocations)
        assert {pool for pool, _ in allocations} == {engine.pool}
        left = engine.prefix_cache.store.ids() if cache_blocks else ()
        assert len(engine.pool.spare) + len(left) == engine.pool.blocks  # every request's block went back
    assert engine.prefix_cache.stats()["hit_tokens"] > 0 and engine.prefix_cache.stats()["evictions"] > 0


def test_the_newest_request_gives_its_blocks_back_first(tiny):
    """Three prompts admitted in one step fill the pool; when their decode needs a block more, the third goes."""
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [rand_ids(n, 30 + n) for n in (7, 7, 7)]  # 2 blocks of 4 each: the 8th token needs a third
    engine = Engine(tiny, EngineConfig(prefill_chunk=64, prefix_block=4, kv_bytes=pool_blocks(tiny, 7, 4)))
    sched = engine.scheduler
    gens = [sched.submit(p, greedy) for p in prompts]
    preempted = []
    while not sched.idle:
        plan = sched.schedule()
        preempted += [r.gen for r in plan.preempted]
        sched.postprocess(plan, *engine.executor.run(plan)[:2])
    assert preempted and preempted[0] is gens[2] and gens[0] not in preempted
    assert [g.token_ids for g in gens] == [engine.generate(p, greedy).run().token_ids for p in prompts]


def test_a_request_larger_than_the_pool_fails_alone_and_says_why(tiny):
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine = Engine(tiny, EngineConfig(prefill_chunk=64, prefix_block=4, kv_bytes=pool_blocks(tiny, 6, 4)))
    small = [rand_ids(6, 40), rand_ids(5, 41)]
    want = [engine.generate(p, greedy).run().token_ids for p in small]
    ended = {}
    sched = engine.scheduler
    big = sched.submit(rand_ids(30, 42), greedy, on_finish=lambda gen, error: ended.setdefault("big", error))
    gens = [sched.submit(p, greedy) for p in small]
    sched.run()
    assert big.finish_reason == "error" and isinstance(ended["big"], PoolExhausted)
    assert re.search(r"needs KV for at least \d+ tokens, more than it can get alone: the KV pool's 6 blocks "
                     r"\(24 tokens\) are all in use; raise the engine's kv_bytes", str(ended["big"]))
    assert [g.token_ids for g in gens] == want and {g.finish_reason for g in gens} == {"length"}
    with pytest.raises(PoolExhausted, match="6 blocks"):  # through generate() the error is raised
        engine.generate(rand_ids(30, 43), greedy).run()
    assert engine.generate(small[0], greedy).run().token_ids == want[0]  # and the engine goes on


@pytest.mark.real_model
def test_smollm2_on_a_pool_of_seven_blocks_gives_the_tokens_of_a_large_pool(smollm2, allocations):
    """Four chat requests of about 40 + 16 tokens on a pool of seven 16-token blocks (with a prefix cache of four
    more, then without): all blocks from the pool's one allocation, preemptions, and the greedy tokens unchanged."""
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [smollm2.encode_chat([{"role": "user", "content": q}]) for q in PROMPTS]
    assert smollm2.runner.cpu_decode and all(len(p) + 16 <= 4 * 16 for p in prompts)  # each fits alone
    want = [g.token_ids for g in Engine(smollm2).generate_batch(prompts, greedy)]
    for cache_blocks in (4, None):
        allocations.clear()
        gens, sched, engine = run_crowded(smollm2, 16, 7, prompts, greedy, cache_blocks)
        assert [g.token_ids for g in gens] == want and sched.preemptions > 0
        assert allocations and all(inside for _, inside in allocations)


PROMPTS = ["What is the capital of France?", "Name three colours.", "Write a haiku about rain.",
           "Tell me a fact about the moon."]


def test_choices_of_one_prompt_on_a_small_pool_give_the_tokens_of_a_large_pool(tiny, allocations):
    """n=3 seeded choices of two prompts on pools of 10 and 14 blocks: the copies kept for waiting choices are
    dropped for room (they prefill on their own), and every choice ends with the tokens it gets on a large pool."""
    seeded = SamplingParams(temperature=0.1, seed=3, max_tokens=10, ignore_eos=True)
    prompts = [rand_ids(14, 50), rand_ids(17, 51)]
    want = [g.token_ids for g in Engine(tiny, EngineConfig(prefill_chunk=64)).generate_batch(prompts, seeded, n=3)]
    for kv_blocks in (10, 14):
        engine = Engine(tiny, EngineConfig(prefill_chunk=64, prefix_block=4, kv_bytes=pool_blocks(tiny, kv_blocks, 4)))
        gens = engine.generate_batch(prompts, seeded, n=3)
        assert [g.token_ids for g in gens] == want and {g.finish_reason for g in gens} == {"length"}
        assert engine.scheduler.preemptions > 0 and all(inside for _, inside in allocations)
