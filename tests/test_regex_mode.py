"""Regex mode (vLLM's structured_outputs.regex / guided_regex): bad patterns refused by name, SmolLM2 alone and
batched, and the CLI (the server's forms: tests/serving/test_serve_structured.py)."""

import re

import pytest

from kvtool import SamplingParams
from kvtool.errors import InvalidParameterError

DATE = r"\d{4}-\d{2}-\d{2}"


@pytest.mark.parametrize("kw,words", [(dict(regex="(ab"), "regex parse error"),
                                      (dict(regex=""), "non-empty"),
                                      (dict(regex="a", choice=["a"]), "one structure"),
                                      (dict(regex="a", response_format="json_object"), "one structure"),
                                      (dict(regex="a", min_tokens=2), "min_tokens")])
def test_bad_values_name_the_parameter(kw, words):
    with pytest.raises(InvalidParameterError, match=f"(regex|choice).*{words}"):
        SamplingParams(**kw).validate()


@pytest.mark.real_model
def test_smollm2_answers_in_the_pattern_alone_and_batched(smollm2):
    from kvtool.engine import Engine

    engine = Engine(smollm2)
    prompt = smollm2.encode_chat([{"role": "user", "content": "When did the Second World War end? "
                                                                 "Give the date."}])
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


def test_unwritable_characters_follow_the_bytes_no_token_has():
    from kvtool.structured.grammar import unwritable_chars as unwritable

    assert unwritable(set(range(256))) == ()
    missing = {0x04, 0xc3, 0xed, 0xf1, 0xf4}  # ASCII; the lead bytes of U+00C0-, U+D000- and U+40000-, U+100000-
    assert unwritable(set(range(256)) - missing) == ((0x04, 0x04), (0xc0, 0xff), (0xd000, 0xd7ff),
                                                     (0x40000, 0x7ffff), (0x100000, 0x10ffff))


@pytest.mark.real_model
def test_a_pattern_smollm2_cannot_write_is_refused_with_the_request(smollm2):
    from kvtool.engine import Engine

    engine = Engine(smollm2)
    with pytest.raises(InvalidParameterError, match="no text this model can write"):
        engine.generate([1, 2], SamplingParams(regex="W\x14"))  # no token of SmolLM2 has the byte 0x14
    assert engine.generate([1, 2], SamplingParams(regex="W\x14|Wa", max_tokens=4)).run().text == "Wa"
