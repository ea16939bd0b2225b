"""The paged KV path (a prefix cache's requests on the C++ CPU ops: KVCache.paged, commit keeping the blocks the
requests filled) held to the reference forward on both real models: the same greedy tokens and cached-token
counts for a single request, a batch whose prompts hit the cache at a block boundary, inside a block and whole,
seeded choices of one prompt (forks), requests preempted under a small KV budget, and a question after a cached
context edited in place (POST /v1/cache/edit's path). Skill blocks: tests/skill_blocks/test_skills_real.py."""

from __future__ import annotations

import pytest

from kvtool import SamplingParams
from kvtool.bench.edit_cases import CASES
from kvtool.cache.manager import attach_prefix_cache
from kvtool.engine import Engine
from kvtool.engine.batch import BatchScheduler
from kvtool.serving.cache_edit_http import _apply
from kvtool.skills.edit import plan_edit

pytestmark = pytest.mark.real_model

GREEDY = SamplingParams(temperature=0, max_tokens=8)
SYSTEM = "You answer for a small bakery in one sentence, prices in euros; it opens at 7:00 and closes at 18:00."


def workload(model) -> dict:
    engine = Engine(model)
    cache = attach_prefix_cache(engine, budget_bytes=64 << 20)
    base = model.encode(model.render([{"role": "system", "content": SYSTEM},
                                      {"role": "user", "content": "How much is a croissant?"}]))
    tails = [model.encode(text) for text in (" And rye bread?", " Do you open on Sundays?", " Any vegan cakes?")]
    assert len(base) > 48
    out = {"single": engine.generate(base, GREEDY).run().token_ids}
    prompts = [base[:32] + tails[0], base[:40] + tails[1], base + tails[2]]
    out["batch"] = [(g.token_ids, g.timings.cached_tokens) for g in engine.generate_batch(prompts, GREEDY)]
    seeded = SamplingParams(temperature=0.8, seed=7, max_tokens=8)
    out["choices"] = [g.token_ids for g in engine.generate_batch([base + tails[0]], seeded, n=3)]
    cache.reset()
    asks = [model.encode(model.render([{"role": "user", "content": text}]))
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
    asked = engine.generate(done["token_ids"] + model.encode(model.render(
        [{"role": "user", "content": case.question}], add_generation_prompt=True)), GREEDY).run()
    out["edit"] = (done["token_ids"], done["recomputed_tokens"], asked.token_ids, asked.timings.cached_tokens)
    cache.check_integrity()
    store = cache.store  # on the C++ path every block came from the pool, and all but the cache's are back
    out["pool"] = not store.pool_blocks or len(store.spare) + len(store.ids()) == store.pool_blocks
    return out


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
