"""Prompt logprobs (SamplingParams.prompt_logprobs) on the real SmolLM2: equal to a full forward's, chunk by
chunk, alone and batched, past a prefix-cache hit, and the generation after them unchanged."""

import pytest
import torch

from kvtool import SamplingParams
from kvtool.cache.manager import attach_prefix_cache
from kvtool.config import EngineConfig
from kvtool.engine import Engine

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def reference(smollm2):
    prompt = smollm2.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    logits = smollm2.runner.prefill(prompt, smollm2.runner.new_cache(), logits="all")
    greedy = Engine(smollm2).generate(prompt, SamplingParams(temperature=0, max_tokens=8)).run().token_ids
    return prompt, torch.log_softmax(logits.float(), dim=-1), greedy


def check_rows(rows, prompt, logp, top):
    assert [r.token_id for r in rows] == prompt and rows[0].logprob is None and rows[0].rank is None
    want = [logp[i, prompt[i + 1]].item() for i in range(len(prompt) - 1)]
    assert [r.logprob for r in rows[1:]] == pytest.approx(want, abs=1e-4)
    for r in rows[1:]:
        assert len(r.top) == top and all(a[1] >= b[1] for a, b in zip(r.top, r.top[1:]))
        if r.rank <= top:  # the prompt token is among the alternatives, at its rank
            assert r.top[r.rank - 1][0] == r.token_id
        elif top:
            assert r.token_id not in [t for t, _ in r.top] and r.logprob <= r.top[-1][1] + 1e-6


def test_scored_in_chunks_past_a_cache_hit_and_the_answer_is_unchanged(smollm2, reference):
    prompt, logp, greedy = reference
    engine = Engine(smollm2, EngineConfig(prefill_chunk=16))  # several scoring chunks
    attach_prefix_cache(engine, budget_bytes=64 << 20)
    engine.generate(prompt, SamplingParams(temperature=0, max_tokens=2)).run()  # the prompt is cached now
    gen = engine.generate(prompt, SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=3)).run()
    check_rows(gen.prompt_logprobs, prompt, logp, 3)
    assert gen.token_ids == greedy
    assert gen.timings.cached_tokens == 0 and gen.timings.prefill_tokens == len(prompt)  # no hit: logits needed
    assert engine.generate(prompt, SamplingParams(temperature=0, max_tokens=1)).run().prompt_logprobs is None


def test_batched_with_choices_and_other_requests(smollm2, reference):
    from kvtool.engine.scheduler import BatchScheduler

    prompt, logp, greedy = reference
    engine = Engine(smollm2, EngineConfig(prefill_chunk=16))
    attach_prefix_cache(engine, budget_bytes=64 << 20)
    gens = engine.generate_batch([prompt, prompt[:9]], [SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=0),
                                                       SamplingParams(temperature=0, max_tokens=8)], n=2)
    for g in gens[:2]:  # both choices of the scored prompt carry its rows; the other prompt has none
        check_rows(g.prompt_logprobs, prompt, logp, 0)
        assert g.token_ids == greedy
    assert gens[2].prompt_logprobs is None and gens[2].token_ids == gens[3].token_ids
    sched = BatchScheduler(engine, max_running=1, prefill_budget=16, kv_budget_tokens=len(prompt) + 4)
    scored = sched.submit(prompt, SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=1))
    sched.run()  # one row under a small KV budget: runs alone
    check_rows(scored.prompt_logprobs, prompt, logp, 1)
    assert scored.token_ids == greedy


def test_scoring_rides_the_chunked_prefill_beside_a_running_stream(smollm2, reference):
    """A scored prompt is prefilled in prefill_budget chunks like any other: the stream running beside it gets
    a token every step. Preempted halfway, it is scored again from its start."""
    from kvtool.engine.scheduler import BatchScheduler

    prompt, logp, greedy = reference
    stream = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for budget in (None, len(prompt) + 7):  # 7: admitted beside the stream, which then outgrows it
        sched = BatchScheduler(Engine(smollm2), max_running=2, prefill_budget=8, kv_budget_tokens=budget)
        other = sched.submit(prompt[:5], stream)
        sched.step()
        scored = sched.submit(prompt, SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=2))
        steps = []
        while scored.prompt_logprobs is None and not sched.idle:
            before = len(other.token_ids)
            sched.step()
            steps.append(len(other.token_ids) - before)
        if budget is None:
            assert len(steps) == -(-len(prompt) // 8) and set(steps) == {1}, steps
        else:  # the stream outgrew the budget mid-scoring: the scored prompt (newest) gave way
            assert sched.preemptions >= 1 and other.finish_reason == "length"
        sched.run()
        check_rows(scored.prompt_logprobs, prompt, logp, 2)
        assert scored.token_ids == greedy


def test_bad_values_are_refused(smollm2):
    from kvtool.errors import InvalidParameterError

    for bad in (-1, 21, 2.5, True):
        with pytest.raises(InvalidParameterError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad).validate()
