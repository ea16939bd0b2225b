"""Choice mode (guided_choice) and allowed_token_ids: the constraint on a toy vocabulary, then SmolLM2."""

import pytest
import torch

from kvtool import SamplingParams
from kvtool.engine.sampling import Sampler
from kvtool.errors import InvalidParameterError
from kvtool.structured.choice import ChoiceConstraint

PIECES = ["", "n", "o", "no", " way", "yes", "y", "<|im_end|>", "es", "w"]
SPECIAL, STOP = {7}, {7}


def test_only_starts_of_a_choice_and_the_end_after_a_whole_one():
    c = ChoiceConstraint(PIECES, SPECIAL, STOP, ["no", "no way", "yes"])
    allowed = lambda: {t for t in range(len(PIECES)) if c.next_state(t) is not None}  # noqa: E731
    assert allowed() == {1, 3, 5, 6} and not c.finished
    c.accept(3)  # "no": a whole choice, and "no way" goes on from it
    assert allowed() == {4, 7} and not c.finished
    c.accept(4)
    assert c.finished and allowed() == {7}
    c = ChoiceConstraint(PIECES, SPECIAL, STOP, ["no", "no way", "yes"])
    c.accept(6)
    assert allowed() == {8}
    with pytest.raises(ValueError, match="does not continue any choice"):
        c.accept(1)


def test_sampling_under_it_draws_only_choices():
    logits = torch.zeros(len(PIECES))
    logits[9] = 5.0  # the model wants "w", which starts no choice here
    for seed in range(20):
        s = Sampler(SamplingParams(temperature=1.0, seed=seed).validate(), len(PIECES), [], torch.device("cpu"))
        s.constraint = ChoiceConstraint(PIECES, SPECIAL, STOP, ["yes", "no"])
        out = ""
        while True:
            t = s(logits).token
            if t in STOP:
                break
            out += PIECES[t]
        assert out in ("yes", "no")


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
    prompt = smollm2.encode(smollm2.render([{"role": "user", "content": question}]))
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
