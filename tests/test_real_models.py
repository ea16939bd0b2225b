"""Parity and generation on the real offline GGUF models (SmolLM2 and Qwen2.5-Coder)."""

import pytest
import torch

from kvtool import SamplingParams
from kvtool.engine import Engine

pytestmark = pytest.mark.real_model

TEXT = ("The history of the city begins with a small fishing village on the river. Over centuries, merchants "
        "arrived, bridges were built, and the markets grew into one of the busiest trading hubs in the region. "
        "Today the old town keeps its narrow streets, while the new districts host universities, parks and a "
        "harbour that handles ships from every continent. Visitors often ask which season is best for a trip; ") * 3


def prompt_200(model):
    ids = model.encode(TEXT)
    assert len(ids) >= 200
    return ids[:200]


@pytest.mark.parametrize("name", ["smollm2", "qwen25"])
def test_logits_match_transformers(name, request):
    model, hf = request.getfixturevalue(name), request.getfixturevalue(f"{name}_hf")
    ids = prompt_200(model)
    ours = torch.log_softmax(model.runner.prefill(ids, model.runner.new_cache(), chunk=64, logits="all"), -1)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    diff = (ours - ref).abs().max().item()
    assert diff <= 1e-3, f"max |log-softmax diff| = {diff}"


@pytest.mark.parametrize("name", ["smollm2", "qwen25"])
def test_greedy_64_tokens_match_transformers_generate(name, request):
    model, hf = request.getfixturevalue(name), request.getfixturevalue(f"{name}_hf")
    prompt = model.encode_chat([{"role": "user", "content": "Write a long story about a lighthouse keeper."}])
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=64, do_sample=False)[0, len(prompt):].tolist()
    # like with like: the oracle has no generation config, so no repetition penalty (Qwen2.5's card names 1.05)
    gen = Engine(model).generate(prompt, SamplingParams(temperature=0, repetition_penalty=1.0, max_tokens=64)).run()
    assert gen.token_ids == ref
    assert len(ref) == 64, "the prompt should keep the model talking for 64 tokens"


def test_smollm2_knows_paris(smollm2):
    prompt = smollm2.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    gen = Engine(smollm2).generate(prompt, SamplingParams(temperature=0, max_tokens=40)).run()
    assert "Paris" in gen.text
    assert gen.finish_reason == "stop"
    t = gen.timings
    assert t.prompt_tokens == len(prompt) and t.ttft_ms > 0 and t.decode_tokens == len(gen.token_ids)


def test_streaming_equals_non_streaming_for_a_seed(smollm2):
    engine = Engine(smollm2)
    prompt = smollm2.encode_chat([{"role": "user", "content": "Tell me a joke about cats."}])
    params = dict(temperature=0.9, top_p=0.95, top_k=40, seed=1234, max_tokens=40)
    streamed = [ev.token_id for ev in engine.generate(prompt, SamplingParams(**params))]
    whole = engine.generate(prompt, SamplingParams(**params)).run()
    assert streamed == whole.token_ids
    other = engine.generate(prompt, SamplingParams(**{**params, "seed": 99})).run()
    assert other.token_ids != whole.token_ids


def test_stream_text_deltas_rebuild_the_text(qwen25):
    engine = Engine(qwen25)
    prompt = qwen25.encode_chat([{"role": "user", "content": "Say 'naïve café 日本' and nothing else."}])
    gen = engine.generate(prompt, SamplingParams(temperature=0, max_tokens=30))
    events = list(gen)
    assert "".join(e.text for e in events) == gen.text
    assert gen.text == qwen25.decode(gen.token_ids[:-1] if gen.finish_reason == "stop" else gen.token_ids,
                                     skip_special_tokens=True)
    assert events[-1].piece == "<|im_end|>" and gen.finish_reason == "stop"


def test_stop_string_and_max_tokens(smollm2):
    engine = Engine(smollm2)
    prompt = smollm2.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    gen = engine.generate(prompt, SamplingParams(temperature=0, max_tokens=40, stop=["Paris"])).run()
    assert gen.finish_reason == "stop" and "Paris" not in gen.text and gen.text.strip()
    gen = engine.generate(prompt, SamplingParams(temperature=0, max_tokens=3)).run()
    assert gen.finish_reason == "length" and len(gen.token_ids) == 3


def test_closing_a_stream_early_aborts(smollm2):
    engine = Engine(smollm2)
    gen = engine.generate(smollm2.encode("Once upon a time"), SamplingParams(temperature=0, max_tokens=50))
    it = iter(gen)
    next(it), next(it)
    gen.close()
    assert gen.finish_reason == "abort" and len(gen.token_ids) == 2


class Spy:
    """Counts the calls of a runner's C++ decode step or prefill pass."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def takes(self, caches):
        return self.inner.takes(caches)

    def __call__(self, *args):
        self.calls += 1
        return self.inner(*args)


def test_the_forward_is_chosen_per_engine_and_both_paths_give_the_same_tokens(smollm2, monkeypatch):
    """kvtool.load(forward="reference") makes every step take the reference forward; the default takes the C++
    CPU ops. Greedy decoding through either gives the same tokens; an engine set to the reference runs it on a model
    loaded with the ops (its steps never call them), and one set to the ops refuses a model loaded without them."""
    import kvtool
    from kvtool.config import EngineConfig
    from kvtool.errors import InvalidParameterError
    from kvtool.testing.models import smollm2_gguf

    ref = kvtool.load(str(smollm2_gguf()), device="cpu", dtype="float32", progress=False, forward="reference")
    assert (smollm2.runner.forward_path, ref.runner.forward_path) == ("cpu-ops", "reference")
    assert ref.info["forward"] == "reference" and not (ref.runner.cpu_decode or ref.runner.cpu_prefill)
    prompt = smollm2.encode_chat([{"role": "user", "content": "Write a long story about a lighthouse."}])
    greedy = SamplingParams(temperature=0, max_tokens=32)
    spies = [Spy(smollm2.runner._cpu_step), Spy(smollm2.runner._cpu_prefill)]
    monkeypatch.setattr(smollm2.runner, "_cpu_step", spies[0])
    monkeypatch.setattr(smollm2.runner, "_cpu_prefill", spies[1])
    reference = Engine(smollm2, EngineConfig(forward="reference")).generate(prompt, greedy).run()
    assert [spy.calls for spy in spies] == [0, 0]
    ops = Engine(smollm2, EngineConfig(forward="cpu-ops")).generate(prompt, greedy).run()
    assert spies[0].calls == 31 and spies[1].calls == 1
    assert Engine(ref, EngineConfig(forward="reference")).generate(prompt, greedy).run().token_ids == ops.token_ids
    assert reference.token_ids == ops.token_ids
    with pytest.raises(InvalidParameterError, match="forward='cpu-ops', but this model was loaded without"):
        Engine(ref, EngineConfig(forward="cpu-ops"))
