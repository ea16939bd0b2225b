"""The paged KV path (a prefix cache's requests on the C++ CPU ops: KVCache.paged, commit keeping the blocks the
requests filled) held to the reference forward on both real models: the same greedy tokens and cached-token
counts for a single request, a batch whose prompts hit the cache at a block boundary, inside a block and whole,
seeded choices of one prompt (forks), requests preempted under a small KV budget, and a question after a cached
context edited in place (POST /v1/cache/edit's path); on tiny random Qwen3, Qwen2 and Llama checkpoints too (without
the edit). Skill blocks: tests/skill_blocks/test_skills_real.py."""

from __future__ import annotations

import pytest

from kvtool import SamplingParams
from kvtool.bench.edit_cases import CASES
from kvtool.cache.manager import attach_prefix_cache
from kvtool.engine import Engine
from kvtool.engine.scheduler import BatchScheduler
from kvtool.serving.cache_edit_http import _apply
from kvtool.config import EngineConfig
from kvtool.skills.edit import plan_edit
from kvtool.testing.tiny import tiny_checkpoint, tiny_runner
from tests.cache.test_manager import TinyModel, rand_ids

GREEDY = SamplingParams(temperature=0, max_tokens=8)
SYSTEM = "You answer for a small bakery in one sentence, prices in euros; it opens at 7:00 and closes at 18:00."


def workload(model) -> dict:
    engine = Engine(model)
    cache = attach_prefix_cache(engine, budget_bytes=64 << 20)
    base = model.encode_chat([{"role": "system", "content": SYSTEM},
                              {"role": "user", "content": "How much is a croissant?"}])
    tails = [model.encode_rendered(t) for t in (" And rye bread?", " Do you open on Sundays?", " Any vegan cakes?")]
    assert len(base) > 48
    out = {"single": engine.generate(base, GREEDY).run().token_ids}
    prompts = [base[:32] + tails[0], base[:40] + tails[1], base + tails[2]]
    out["batch"] = [(g.token_ids, g.timings.cached_tokens) for g in engine.generate_batch(prompts, GREEDY)]
    seeded = SamplingParams(temperature=0.8, seed=7, max_tokens=8)
    out["choices"] = [g.token_ids for g in engine.generate_batch([base + tails[0]], seeded, n=3)]
    cache.reset()
    asks = [model.encode_chat([{"role": "user", "content": text}])
            for text in ("Tell me about rye.", "What makes a baguette?", "Why is sourdough sour?")]
    sched = BatchScheduler(engine, max_running=4, prefill_budget=256, kv_budget_tokens=len(asks[0]) + len(asks[1]) + 4)
    gens = [sched.submit(p, GREEDY) for p in asks]  # the first two start together and outgrow the budget
    sched.run()
    out["preempted"], out["preemptions"] = [g.token_ids for g in gens], sched.preemptions > 0
    case = CASES[0]  # a cached context whose field is edited in place, then a question after it
    text = model.render(case.messages(case.old), add_generation_prompt=False)
    edit = plan_edit(model, text, case.field_span(text), case.new)
    cache.pin(edit.old_ids)
    done = _apply(cache, model, edit.old_ids, edit, "field_only", None, None, False)
    asked = engine.generate(done["token_ids"] + model.encode_chat(
        [{"role": "user", "content": case.question}], add_generation_prompt=True), GREEDY).run()
    out["edit"] = (done["token_ids"], done["recomputed_tokens"], asked.token_ids, asked.timings.cached_tokens)
    cache.check_integrity()
    out["pool"] = pool_is_whole(cache)
    return out


def pool_is_whole(cache) -> bool:
    pool = cache.store.pool  # on the C++ path every block came from the pool, and all but the cache's are back
    return not pool.blocks or len(pool.spare) + len(cache.store.ids()) == pool.blocks


def tiny_workload(model) -> dict:
    """The real models' workload without the edit, on 4-token blocks: every kind of hit, forks and preemption."""
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    engine = Engine(model, EngineConfig(prefill_chunk=16))
    cache = attach_prefix_cache(engine, budget_bytes=1 << 22, block_size=4)
    base = rand_ids(38, 1)
    out = {"single": engine.generate(base, greedy).run().token_ids}
    prompts = [base[:16] + rand_ids(5, 2), base[:23] + rand_ids(7, 3), base + rand_ids(3, 4), base]
    out["batch"] = [(g.token_ids, g.timings.cached_tokens) for g in engine.generate_batch(prompts, greedy)]
    seeded = SamplingParams(temperature=0.1, seed=3, max_tokens=10, ignore_eos=True)  # low: each draw reads the KV
    out["choices"] = [g.token_ids for g in engine.generate_batch([base[:19] + [9]], seeded, n=3)]
    paged, hit, handle = engine.start_cache(base + [1])  # a hit: the cache's blocks by reference, then a page
    out["paged"] = paged.layers[0].page is not None and paged.layers[0].base == 36 and hit == 38
    cache.commit(handle, base, paged)
    cache.reset()
    asks = [rand_ids(n, 10 + n) for n in (40, 33, 21)]
    sched = BatchScheduler(engine, max_running=4, prefill_budget=64, kv_budget_tokens=40 + 33 + 4)
    gens = [sched.submit(p, greedy) for p in asks]  # the first two start together and outgrow the budget
    sched.run()
    out["preempted"], out["preemptions"] = [g.token_ids for g in gens], sched.preemptions > 0
    cache.check_integrity()
    del paged
    out["pool"] = pool_is_whole(cache)
    plain = Engine(model, EngineConfig(prefill_chunk=16))  # no prefix cache: paged caches from the engine's pool
    out["plain"] = [g.token_ids for g in plain.generate_batch(prompts, greedy)]
    out["plain choices"] = [g.token_ids for g in plain.generate_batch([base[:19] + [9]], seeded, n=3)]
    sched = BatchScheduler(plain, max_running=4, prefill_budget=64, kv_budget_tokens=40 + 33 + 4)
    gens = [sched.submit(p, greedy) for p in asks]
    sched.run()
    out["plain preempted"] = [g.token_ids for g in gens], sched.preemptions > 0
    fresh, pool, cpu = plain.start_cache(base)[0], plain.pool, model.runner.cpu_decode
    out["plain paged"] = (fresh.layers[0].page is not None) == cpu == (len(pool.spare) < pool.blocks)
    del fresh
    out["plain pool"] = len(pool.spare) == pool.blocks  # every page went back
    return out


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
def test_the_paged_path_gives_the_reference_forwards_tokens_on_tiny_models(family, tmp_path):
    tiny_checkpoint(family, tmp_path)
    model = TinyModel(tiny_runner(family, tmp_path))
    runner = model.runner
    assert runner.forward_path == "cpu-ops"
    paged = tiny_workload(model)
    runner.use_cpu_decode(False)
    reference = tiny_workload(model)
    assert paged["preemptions"] and paged["plain preempted"][1] and paged["pool"] and paged["plain pool"]
    assert paged["paged"] and paged["plain paged"] and reference["paged"] and reference["plain paged"]
    assert paged["batch"][3][1] == 37 and [n for _, n in paged["batch"][:3]] == [16, 23, 38]
    assert paged == reference


@pytest.mark.real_model
@pytest.mark.parametrize("name", ["smollm2", "qwen25"])
def test_the_paged_path_gives_the_reference_forwards_tokens(name, request):
    model = request.getfixturevalue(name)
    runner = model.runner
    assert runner.forward_path == "cpu-ops"
    paged = workload(model)
    runner.use_cpu_decode(False)
    try:
        reference = workload(model)
    finally:
        runner.use_cpu_decode(True)
    assert runner.forward_path == "cpu-ops" and paged["preemptions"] and paged["pool"]
    assert paged == reference
