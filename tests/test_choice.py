"""Choice mode (guided_choice) and allowed_token_ids: bad values refused by name, then SmolLM2 (the mask itself:
tests/test_json_mode.py)."""

import pytest

from kvtool import SamplingParams
from kvtool.errors import InvalidParameterError


@pytest.mark.parametrize("kw,name", [(dict(choice=[]), "choice"), (dict(choice=["a", ""]), "choice"),
                                     (dict(choice=["a"], response_format="json_object"), "choice"),
                                     (dict(allowed_token_ids=[]), "allowed_token_ids"),
                                     (dict(allowed_token_ids=[-1]), "allowed_token_ids")])
def test_bad_values_name_the_parameter(kw, name):
    with pytest.raises(InvalidParameterError, match=name):
        SamplingParams(**kw).validate()


@pytest.mark.real_model
def test_smollm2_answers_with_one_of_the_choices(smollm2):
    from kvtool.engine import Engine

    engine = Engine(smollm2)
    question = "Review: 'Terrible, boring, a waste of two hours.' Is the review positive or negative?"
    prompt = smollm2.encode_chat([{"role": "user", "content": question}])
    free = engine.generate(prompt, SamplingParams(temperature=0, max_tokens=12)).run()
    assert free.text not in ("positive", "negative")  # left alone, it writes a sentence
    choices = ["positive", "negative"]
    greedy = engine.generate(prompt, SamplingParams(temperature=0, max_tokens=12, choice=choices)).run()
    assert greedy.text in choices and greedy.finish_reason == "stop"
    sampled = engine.generate_batch([prompt], SamplingParams(temperature=1.0, seed=4, max_tokens=12, choice=choices),
                                    n=6)
    assert all(g.text in choices and g.finish_reason == "stop" for g in sampled)
    with pytest.raises(InvalidParameterError, match="allowed_token_ids token ids"):
        engine.generate(prompt, SamplingParams(allowed_token_ids=[10**7]))
    eos = sorted(engine.end_of_turn)
    with pytest.raises(InvalidParameterError, match="only stop tokens"):
        engine.generate(prompt, SamplingParams(allowed_token_ids=eos, min_tokens=2))
    assert engine.generate(prompt, SamplingParams(allowed_token_ids=eos)).run().token_ids[0] in eos
