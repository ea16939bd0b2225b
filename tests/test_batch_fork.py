"""Sibling requests (the n choices of one prompt) prefill their prompt once and sample as if alone."""

import pytest

from kvtool import SamplingParams
from kvtool.engine import Engine
from kvtool.engine.forks import Fork
from kvtool.engine.scheduler import BatchScheduler

QUESTION = "Write a haiku about rain."


@pytest.fixture(scope="module")
def engine_prompt(smollm2):
    return Engine(smollm2), smollm2.encode_chat([{"role": "user", "content": QUESTION}])


def run_counting(sched) -> int:
    """Run to the end; the tokens that went through the model."""
    forwarded = 0
    while not sched.idle:
        forwarded += sched.step()
    return forwarded


@pytest.mark.real_model
def test_seeded_siblings_prefill_once_and_each_equals_its_solo_run(engine_prompt):
    engine, prompt = engine_prompt
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=s, max_tokens=12) for s in (7, 8, 9)]
    solo = [engine.generate(prompt, p).run().token_ids for p in params]
    assert len({tuple(t) for t in solo}) > 1  # the seeds differ, so would the choices

    sched = BatchScheduler(engine, max_running=4, prefill_budget=16)
    fork = Fork()
    events = {i: [] for i in range(3)}
    gens = [sched.submit(prompt, p, on_event=lambda e, i=i: events[i].append(e.token_id), shared=fork)
            for i, p in enumerate(params)]
    forwarded = run_counting(sched)
    for i, g in enumerate(gens):
        assert g.token_ids == solo[i], f"choice {i} differs from its solo run"
        assert events[i] == g.token_ids
    # the prompt once, then every sampled token but each choice's last
    assert forwarded == len(prompt) + sum(len(g.token_ids) - 1 for g in gens)
    assert [g.timings.cached_tokens for g in gens] == [0, len(prompt), len(prompt)]
    assert all(g.timings.ttft_ms > 0 and g.timings.prefill_ms > 0 for g in gens)
    assert fork.cache is None and fork.logits is None  # the copy went to the last sibling


@pytest.mark.real_model
def test_greedy_siblings_equal_the_single_answer_beside_other_requests(engine_prompt):
    """Siblings of a prompt (and of a one-token prompt) start from the leader's KV copy and answer as a single
    request does, beside another request."""
    engine, prompt = engine_prompt
    greedy = SamplingParams(temperature=0, max_tokens=10)
    for ids in (prompt, prompt[:1]):
        want = engine.generate(ids, greedy).run().token_ids
        other = engine.generate(prompt[:7], greedy).run().token_ids
        sched = BatchScheduler(engine, max_running=3, prefill_budget=16)
        first = sched.submit(prompt[:7], greedy)
        fork = Fork()
        gens = [sched.submit(ids, greedy, shared=fork) for _ in range(3)]  # one waits for a free row
        sched.run()
        assert first.token_ids == other
        assert [g.token_ids for g in gens] == [want] * 3, f"prompt of {len(ids)} tokens"


@pytest.mark.real_model
def test_the_scheduler_plans_and_the_executor_runs_each_plan(engine_prompt, monkeypatch):
    """schedule() returns the step's Plan without a forward or a draw; the engine's StepExecutor runs it (one
    forward, the samples); postprocess() takes them. The first of three choices prefills the prompt while the others
    wait; then they start from its logits (a Plan of them alone, given: no forward) and decode beside it."""
    engine, prompt = engine_prompt
    greedy = SamplingParams(temperature=0, max_tokens=4)
    want = engine.generate(prompt, greedy).run().token_ids
    forwards, run = [], engine.runner.run
    monkeypatch.setattr(engine.runner, "run", lambda plan: forwards.append(plan) or run(plan))
    sched = BatchScheduler(engine, max_running=4, prefill_budget=len(prompt))
    fork = Fork()
    gens = [sched.submit(prompt, greedy, shared=fork) for _ in range(3)]

    plan = sched.schedule()
    assert not forwards and [(c.req.gen, c.tokens, c.samples) for c in plan.chunks] == [(gens[0], prompt, True)]
    assert not plan.given and not plan.preempted and len(sched.waiting) == 2
    logits, samples, seconds = engine.executor.run(plan)
    assert len(forwards) == 1 and list(samples) == [plan.chunks[0].req] and seconds > 0
    assert not gens[0].token_ids  # the scheduler takes the sample
    sched.postprocess(plan, logits, samples)
    assert gens[0].token_ids == want[:1] and fork.kept is not None and fork.kept.offset == len(prompt)

    plan = sched.schedule()  # the others start: their first tokens come before the step's chunks are planned
    assert [r.gen for r, _ in plan.given] == gens[1:] and not plan.chunks and fork.kept is None  # (the last took it)
    logits, samples, _ = engine.executor.run(plan)
    sched.postprocess(plan, logits, samples)
    assert len(forwards) == 1 and [g.token_ids for g in gens] == [want[:1]] * 3
    plan = sched.schedule()
    assert [(c.req.gen, c.tokens) for c in plan.chunks] == [(g, want[:1]) for g in gens] and plan.tokens == 3
    logits, samples, _ = engine.executor.run(plan)
    sched.postprocess(plan, logits, samples)
    assert len(forwards) == 2 and [g.token_ids for g in gens] == [want[:2]] * 3
    sched.run()
    assert [g.token_ids for g in gens] == [want] * 3


def test_the_scheduler_knows_shared_prompts_only_through_their_seam():
    """The n choices' sharing lives in kvtool.engine.forks; the scheduler calls it through SharedPrompt alone."""
    from pathlib import Path

    import kvtool.engine.scheduler as scheduler

    assert "fork" not in Path(scheduler.__file__).read_text(encoding="utf-8").lower()


@pytest.mark.real_model
def test_siblings_prefill_alone_when_the_leader_ends_first_and_cancelled_ones_free_the_copy(engine_prompt):
    engine, prompt = engine_prompt
    greedy = SamplingParams(temperature=0, max_tokens=6)
    want = engine.generate(prompt, greedy).run().token_ids

    sched = BatchScheduler(engine, max_running=4, prefill_budget=8)
    fork = Fork()
    gens = [sched.submit(prompt, greedy, shared=fork) for _ in range(3)]
    sched.step()  # the leader has prefilled 8 prompt tokens; its siblings wait
    assert len(sched.running) == 1 and len(sched.waiting) == 2
    sched.cancel(gens[0])
    assert fork.abandoned
    sched.run()
    assert gens[0].finish_reason == "abort" and [g.token_ids for g in gens[1:]] == [want] * 2

    sched = BatchScheduler(engine, max_running=1, prefill_budget=512)
    fork = Fork()
    gens = [sched.submit(prompt, greedy, shared=fork) for _ in range(3)]
    sched.step()  # the leader's prefill ends; one row: its siblings wait on its KV copy
    assert fork.cache is not None and fork.cache.offset == len(prompt)
    sched.cancel(gens[1])
    assert fork.cache is not None  # gens[2] still waits for it
    sched.cancel(gens[2])
    assert fork.cache is None and fork.logits is None
    sched.run()
    assert gens[0].token_ids == want

    fork = Fork()
    sched.submit(prompt, greedy, shared=fork)
    with pytest.raises(ValueError, match="same prompt"):
        sched.submit(prompt[:-1], greedy, shared=fork)
    sched.run()


@pytest.mark.real_model
@pytest.mark.parametrize("copies,room", [(2, 10), (2, 2), (1, 4)])
def test_the_copy_for_siblings_counts_against_the_kv_budget(engine_prompt, copies, room):
    """Budget 2L + 10: the copy fits beside the first's KV and the siblings wait for room. 2L + 2: the first's
    decode needs the room, and the copy is dropped rather than the first preempted. L + 4: no copy is made.
    Without the copy, the siblings prefill on their own."""
    engine, prompt = engine_prompt
    greedy = SamplingParams(temperature=0, max_tokens=6)
    want = engine.generate(prompt, greedy).run().token_ids
    budget = copies * len(prompt) + room
    sched = BatchScheduler(engine, max_running=4, prefill_budget=512, kv_budget_tokens=budget)
    fork = Fork()
    gens = [sched.submit(prompt, greedy, shared=fork) for _ in range(3)]
    sched.step()
    assert sched._kv_tokens() == copies * len(prompt)  # the first's KV, and the copy where it fits
    assert (fork.cache is not None) == (copies == 2)
    while not sched.idle:
        sched.step()
        assert sched._kv_tokens() <= budget or (len(sched.running) == 1 and not sched._kept())
        assert not any(r.preemptions for r in sched.requests if r.gen is gens[0])  # not for the copy's sake
    assert [g.token_ids for g in gens] == [want] * 3
    assert fork.abandoned == (room < 10)


@pytest.mark.real_model
def test_generate_batch_equals_single_runs_choice_by_choice(smollm2, engine_prompt):
    from kvtool.errors import InvalidParameterError

    engine, prompt = engine_prompt
    other = smollm2.encode_chat([{"role": "user", "content": "Name three colours."}])
    sampled = SamplingParams(temperature=0.8, seed=21, max_tokens=8)
    greedy = SamplingParams(temperature=0, max_tokens=8)
    gens = engine.generate_batch([prompt, other], [sampled, greedy], n=2)
    want = [engine.generate(prompt, sampled).run().token_ids,
            engine.generate(prompt, SamplingParams(temperature=0.8, seed=22, max_tokens=8)).run().token_ids,
            *[engine.generate(other, greedy).run().token_ids] * 2]
    assert [g.token_ids for g in gens] == want
    assert all(g.finish_reason in ("stop", "length") for g in gens)
    assert [g.token_ids for g in engine.generate_batch([other], greedy)] == [want[2]]
    with pytest.raises(InvalidParameterError, match="2 SamplingParams for 1 prompts"):
        engine.generate_batch([other], [greedy, greedy])
    with pytest.raises(InvalidParameterError, match="n must be"):
        engine.generate_batch([other], greedy, n=0)


@pytest.mark.real_model
@pytest.mark.parametrize("model", ["smollm2", "qwen25"])
def test_siblings_read_the_prompts_cached_blocks_in_place(model, request):
    """With the prefix cache on the C++ CPU path, the copy the siblings start from reads the prompt's full
    blocks (which the first published when its prefill ended) where the cache holds them: it owns only the tokens
    after them, the KV budget counts only those, each sibling's cache reads the same block tensors, the choices
    equal their solo runs, and every hold on the blocks ends with the requests."""
    from kvtool.cache.manager import attach_prefix_cache

    loaded = request.getfixturevalue(model)
    engine = Engine(loaded)
    assert engine.runner.cpu_decode
    prompt = loaded.encode_chat([{"role": "system", "content": "You answer in verse. " * 12},
                                 {"role": "user", "content": QUESTION}])
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=s, max_tokens=8) for s in (3, 4, 5)]
    solo = [engine.generate(prompt, p).run().token_ids for p in params]
    prefix = attach_prefix_cache(engine, budget_bytes=64 << 20, block_size=16)
    shared = len(prompt) // 16 * 16
    assert shared >= 64

    sched = BatchScheduler(engine, max_running=1, prefill_budget=512)  # one row: the siblings wait on the copy
    fork = Fork()
    gens = [sched.submit(prompt, p, shared=fork) for p in params]
    sched.step()  # the first's prefill ends
    blocks = fork.cache.layers[0].blocks
    assert len(blocks) == shared // 16 and fork.cache.own_tokens == len(prompt) - shared
    assert all(layer.blocks is blocks and layer.buffers[0].shape[2] < 100 for layer in fork.cache.layers)
    assert sched._kv_tokens() == len(prompt) + len(prompt) - shared  # the first's KV, and the copy's own tokens
    caches = []
    while not sched.idle:
        sched.step()
        caches += [r.cache for r in sched.running if r.gen is not gens[0] and r.cache not in caches]
    assert len(caches) == 2 and all([b.data_ptr() for b in c.layers[0].blocks] == [b.data_ptr() for b in blocks]
                                    for c in caches)
    assert [g.token_ids for g in gens] == solo
    prefix.check_integrity()
    prefix.set_budget(0)  # evicts every block that no request holds
    assert prefix.stats()["blocks"] == 0


@pytest.mark.real_model
def test_a_hook_without_fork_gives_the_siblings_a_whole_copy(smollm2):
    """A prefix-cache hook with only the required methods (here the prefix cache's own) gets PrefixHook's fork:
    the copy the siblings start from owns the whole prompt and holds no cached block; the choices equal solo runs."""
    from kvtool.cache.hook import DefaultsFor
    from kvtool.cache.manager import PrefixCache

    class RequiredOnly:
        def __init__(self, cache):
            self.prepare, self.publish, self.commit = cache.prepare, cache.publish, cache.commit

    engine = Engine(smollm2)
    prompt = smollm2.encode_chat([{"role": "system", "content": "You answer in verse. " * 12},
                                  {"role": "user", "content": QUESTION}])
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=s, max_tokens=6) for s in (3, 4)]
    solo = [engine.generate(prompt, p).run().token_ids for p in params]
    engine.prefix_cache = RequiredOnly(PrefixCache.for_runner(engine.runner, 64 << 20, pool=engine.pool))
    assert isinstance(engine.prefix_cache, DefaultsFor)
    sched = BatchScheduler(engine, max_running=1, prefill_budget=512)  # one row: the sibling waits on the copy
    fork = Fork()
    gens = [sched.submit(prompt, p, shared=fork) for p in params]
    sched.step()  # the first's prefill ends
    assert fork.handle is None and fork.cache.own_tokens == len(prompt) >= 64
    run_counting(sched)
    assert [g.token_ids for g in gens] == solo


@pytest.mark.real_model
def test_requests_that_arrive_together_on_one_prefix_read_what_the_first_published(smollm2):
    """Three requests on one system prompt, queued at once: only those whose first chunk fits the step's prefill
    budget open their cache (the prefix lookup), so the later ones start after the first published the prompt's
    blocks and prefill only their own question; the answers equal solo runs."""
    from kvtool.cache.manager import attach_prefix_cache

    engine = Engine(smollm2)
    system = {"role": "system", "content": "You answer in verse. " * 12}
    prompts = [smollm2.encode_chat([system, {"role": "user", "content": q}])
               for q in (QUESTION, "Name a prime number.", "What colour is the sky?")]
    greedy = SamplingParams(temperature=0, max_tokens=6)
    solo = [engine.generate(p, greedy).run().token_ids for p in prompts]
    attach_prefix_cache(engine, budget_bytes=64 << 20, block_size=16)
    sched = BatchScheduler(engine, max_running=4, prefill_budget=len(prompts[0]))  # one prompt a step
    gens = [sched.submit(p, greedy) for p in prompts]
    while not sched.idle:
        sched.step()
    shared = next(i for i in range(len(prompts[0])) if len({p[i] for p in prompts}) > 1) // 16 * 16  # full blocks
    assert shared >= 64
    assert [g.token_ids for g in gens] == solo
    assert gens[0].timings.cached_tokens == 0 and all(g.timings.cached_tokens >= shared for g in gens[1:])
