"""Continuous batching: batched greedy outputs equal unbatched ones token for token."""

import pytest
import torch

from kvtool import SamplingParams
from kvtool.engine import Engine
from kvtool.engine.scheduler import BatchScheduler
from kvtool.testing.tiny import tiny_checkpoint, tiny_runner


def test_forward_batch_equals_separate_forwards(tmp_path):
    tiny_checkpoint("qwen3", tmp_path)
    runner = tiny_runner("qwen3", tmp_path)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (5, 17, 1, 9)]
    solo = []
    for p in prompts:
        c = runner.new_cache()
        runner.prefill(p[:-1], c) if len(p) > 1 else None
        solo.append(runner(p[-1:], c))
    caches = [runner.new_cache() for _ in prompts]
    for p, c in zip(prompts, caches):
        if len(p) > 1:
            runner.prefill(p[:-1], c)
    batched = runner.forward_batch([(p[-1:], c) for p, c in zip(prompts, caches)])
    for a, b in zip(solo, batched):
        assert (a - b).abs().max().item() < 1e-4
    # mixed: prefill chunks of different lengths in one call
    caches = [runner.new_cache() for _ in prompts]
    mixed = runner.forward_batch([(p, c) for p, c in zip(prompts, caches)], logits="all")
    for p, out in zip(prompts, mixed):
        ref = runner.prefill(p, runner.new_cache(), logits="all")
        assert out.shape == ref.shape and (out - ref).abs().max().item() < 1e-4
    # a mode per sequence: all rows for some, the last row for the others
    modes = ["all", "last", "last", "all"]
    caches = [runner.new_cache() for _ in prompts]
    picked = runner.forward_batch([(p, c) for p, c in zip(prompts, caches)], logits=modes)
    for out, ref, mode in zip(picked, mixed, modes):
        want = ref if mode == "all" else ref[-1:]
        assert out.shape == want.shape and (out - want).abs().max().item() < 1e-4


PROMPTS = ["What is the capital of France?", "Name three colours.", "Write a haiku about rain.",
           "Tell me a fact about the moon."]
PARAMS = dict(temperature=0, max_tokens=16)


@pytest.fixture(scope="module")
def solo(smollm2):
    engine = Engine(smollm2)
    prompts = [smollm2.encode_chat([{"role": "user", "content": q}]) for q in PROMPTS]
    return engine, prompts, [engine.generate(p, SamplingParams(**PARAMS)).run().token_ids for p in prompts]


@pytest.mark.real_model
def test_batched_greedy_equals_unbatched_with_chunked_prefill(solo):
    engine, prompts, want = solo
    sched = BatchScheduler(engine, max_running=4, prefill_budget=16)
    streamed = {i: [] for i in range(len(prompts))}
    gens = [sched.submit(p, SamplingParams(**PARAMS), on_event=lambda e, i=i: streamed[i].append(e.token_id))
            for i, p in enumerate(prompts)]
    steps = 0
    while not sched.idle:
        sched.step()
        steps += 1
        assert len(sched.running) <= 4
    for i, g in enumerate(gens):
        assert g.token_ids == want[i], f"request {i} differs"
        assert streamed[i] == g.token_ids and g.finish_reason in ("stop", "length")
    # 4 prompts of ~40 tokens at 16 prefill tokens per step cannot finish prefill in one step each
    assert steps > max(len(g.token_ids) for g in gens) + 4


@pytest.mark.real_model
def test_unseeded_rows_sample_together_and_seeded_ones_alone(solo, monkeypatch):
    import kvtool.engine.step as step

    engine, prompts, want = solo
    shared = []
    original = step.sample_rows

    def spy(samplers, logits):
        shared.append(len(samplers))
        return original(samplers, logits)

    monkeypatch.setattr(step, "sample_rows", spy)
    sched = BatchScheduler(engine, max_running=4, prefill_budget=256)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=16)
    params = [SamplingParams(**PARAMS), SamplingParams(**PARAMS, logprobs=2), seeded,
              SamplingParams(**PARAMS, repetition_penalty=1.0)]
    events = []
    gens = [sched.submit(p, sp, on_event=events.append if i == 1 else None)
            for i, (p, sp) in enumerate(zip(prompts, params))]
    sched.run()
    for i in (0, 1, 3):
        assert gens[i].token_ids == want[i], f"request {i} differs"
    assert max(shared) == 3  # the seeded request draws alone, from its own generator
    assert gens[2].token_ids == engine.generate(prompts[2], seeded).run().token_ids
    solo_events = list(engine.generate(prompts[1], SamplingParams(**PARAMS, logprobs=2)))
    assert [e.logprob for e in events] == pytest.approx([e.logprob for e in solo_events], abs=1e-4)
    assert [[t for t, _ in e.top_logprobs] for e in events] == [[t for t, _ in e.top_logprobs] for e in solo_events]
    assert sched.host_s > 0


@pytest.mark.real_model
def test_batched_sampling_with_a_single_candidate_equals_greedy(solo):
    """Unseeded sampled rows go through the batched sampler; top_k=1 or a tiny top_p leaves one token."""
    engine, prompts, want = solo
    sched = BatchScheduler(engine, max_running=4, prefill_budget=256)
    params = [SamplingParams(temperature=1.3, top_k=1, max_tokens=16),
              SamplingParams(temperature=0.7, top_p=1e-6, max_tokens=16),
              SamplingParams(temperature=2.0, min_p=1.0, max_tokens=16), SamplingParams(**PARAMS)]
    gens = [sched.submit(p, sp) for p, sp in zip(prompts, params)]
    sched.run()
    for i, g in enumerate(gens):
        assert g.token_ids == want[i], f"request {i} differs"


@pytest.mark.real_model
def test_preemption_under_kv_pressure_keeps_outputs_and_cancel_works(solo):
    engine, prompts, want = solo
    budget = 90  # two ~36-token prompts are admitted together; their decode outgrows it
    sched = BatchScheduler(engine, max_running=4, prefill_budget=64, kv_budget_tokens=budget)
    gens = [sched.submit(p, SamplingParams(**PARAMS)) for p in prompts]
    extra = sched.submit(prompts[0], SamplingParams(**PARAMS))
    preempted = False
    for _ in range(1000):
        if sched.idle:
            break
        sched.step()
        preempted |= any(r.preemptions for r in list(sched.running) + list(sched.waiting))
        assert sum(r.cache.offset for r in sched.running) <= budget or len(sched.running) == 1
        if len(extra.token_ids) >= 1 and extra.finish_reason is None:
            sched.cancel(extra)
    assert sched.idle and preempted
    assert extra.finish_reason == "abort"
    for i, g in enumerate(gens):
        assert g.token_ids == want[i], f"request {i} differs after preemption"


@pytest.mark.real_model
def test_a_plan_names_the_requests_it_preempts_and_runs_none_of_their_tokens(solo):
    """One prompt a step; both fit the KV budget until they decode together: schedule() preempts the newer one (its
    KV dropped, no chunk of it in the Plan), which is recomputed once the other is done, with the same tokens."""
    engine, prompts, want = solo
    budget = len(prompts[0]) + len(prompts[1]) + 2  # room for the second's admission, not for their 2nd decode
    sched = BatchScheduler(engine, max_running=2, prefill_budget=len(prompts[0]), kv_budget_tokens=budget)
    gens = [sched.submit(p, SamplingParams(**PARAMS)) for p in prompts[:2]]
    preempted = []
    while not sched.idle:
        plan = sched.schedule()
        assert not any(c.req in plan.preempted or c.req.cache is None for c in plan.chunks)
        preempted += [r.gen for r in plan.preempted]
        logits, samples, _ = engine.executor.run(plan)
        sched.postprocess(plan, logits, samples)
    assert preempted == [gens[1]] and sched.preemptions == 1
    assert [g.token_ids for g in gens] == want[:2]
