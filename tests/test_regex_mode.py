"""Regex mode (vLLM's structured_outputs.regex / guided_regex): the constraint on a toy vocabulary, SmolLM2
alone and batched, and the CLI (the server's forms: tests/serving/test_serve_structured.py)."""

import re

import pytest
import torch

from kvtool import SamplingParams
from kvtool.engine.sampling import Sampler
from kvtool.errors import InvalidParameterError
from kvtool.structured.regex_mode import RegexConstraint

PIECES = ["", "1", "12", "9", "-", "a", "<|im_end|>", "-3", "x", "\ufffd", "3"]
SPECIAL, STOP = {6}, {6}
DATE = r"\d{4}-\d{2}-\d{2}"


def allowed(c) -> set[int]:
    return {t for t in range(len(PIECES)) if c.next_state(t) is not None}


def test_tokens_must_keep_a_match_possible_and_the_end_needs_a_whole_one():
    c = RegexConstraint(PIECES, SPECIAL, STOP, r"\d+(-\d)?")
    assert allowed(c) == {1, 2, 3, 10} and not c.finished
    c.accept(2)  # "12": a whole match that may go on
    assert allowed(c) == {1, 2, 3, 4, 6, 7, 10} and not c.finished
    c.accept(7)  # "12-3": nothing can follow
    assert c.finished and allowed(c) == {6}
    with pytest.raises(ValueError, match="does not continue a match"):
        c.accept(1)
    c = RegexConstraint(PIECES, SPECIAL, STOP, r"x.")
    c.accept(8)
    assert 9 in allowed(c)  # a split character is checked as U+FFFD, which '.' takes


def test_sampling_under_it_draws_only_matches():
    logits = torch.zeros(len(PIECES))
    logits[5] = 6.0  # the model wants "a", which the pattern never takes
    for seed in range(20):
        s = Sampler(SamplingParams(temperature=1.0, seed=seed).validate(), len(PIECES), [], torch.device("cpu"))
        s.constraint = RegexConstraint(PIECES, SPECIAL, STOP, r"(1|12|9)-3")
        out = ""
        while (t := s(logits).token) not in STOP:
            out += PIECES[t]
        assert out in ("1-3", "12-3", "9-3")


@pytest.mark.parametrize("kw,words", [(dict(regex="(ab"), "not a valid regular expression"),
                                      (dict(regex=""), "non-empty"),
                                      (dict(regex="a", choice=["a"]), "choice mode"),
                                      (dict(regex="a", response_format="json_object"), "JSON"),
                                      (dict(regex="a", min_tokens=2), "min_tokens")])
def test_bad_values_name_the_parameter(kw, words):
    with pytest.raises(InvalidParameterError, match=f"regex.*{words}"):
        SamplingParams(**kw).validate()


@pytest.mark.real_model
def test_smollm2_answers_in_the_pattern_alone_and_batched(smollm2):
    from kvtool.engine import Engine

    engine = Engine(smollm2)
    prompt = smollm2.encode(smollm2.render([{"role": "user", "content": "When did the Second World War end? "
                                                                        "Give the date."}]))
    free = engine.generate(prompt, SamplingParams(temperature=0, max_tokens=30)).run()
    assert "1945" in free.text and not re.fullmatch(DATE, free.text)  # a sentence, not a date
    greedy = engine.generate(prompt, SamplingParams(temperature=0, max_tokens=30, regex=DATE)).run()
    assert re.fullmatch(DATE, greedy.text) and greedy.text.startswith("1945") and greedy.finish_reason == "stop"
    phone = r"\(\d{3}\) \d{3}-\d{4}"
    params = [SamplingParams(temperature=0, max_tokens=30, regex=DATE), SamplingParams(temperature=0, max_tokens=8)] + [
        SamplingParams(temperature=1.0, seed=s, max_tokens=30, regex=rx) for s, rx in ((1, DATE), (2, phone))]
    batch = engine.generate_batch([prompt] * 4, params)
    assert batch[0].text == greedy.text and batch[1].token_ids == free.token_ids[:8]
    assert re.fullmatch(DATE, batch[2].text) and re.fullmatch(phone, batch[3].text), [g.text for g in batch]


@pytest.mark.real_model
def test_cli_answers_in_a_pattern(capsys):
    from kvtool.cli import main
    from kvtool.testing.models import smollm2_gguf

    assert main(["generate", "When did the Second World War end? Give the date.", "--chat", "--regex", DATE,
                 "--temperature", "0", "--max-tokens", "30", "--model", str(smollm2_gguf())]) == 0
    out = capsys.readouterr()
    assert re.fullmatch(DATE, out.out) and out.out.startswith("1945") and "[stop]" in out.err
