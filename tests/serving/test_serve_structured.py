"""vLLM's ways to structure the output on a live server with SmolLM2: structured_outputs (json, regex, choice),
guided_regex and guided_json; one way per request, each refused clearly when wrong."""

from __future__ import annotations

import json
import re

import pytest

pytestmark = pytest.mark.real_model

DATE = r"\d{4}-\d{2}-\d{2}"
CHAT = {"messages": [{"role": "user", "content": "When did the Second World War end? Give the date."}],
        "temperature": 0, "max_tokens": 30}
SCHEMA = {"type": "object", "properties": {"year": {"type": "integer"}}, "required": ["year"],
          "additionalProperties": False}


def content(smol, **body) -> str:
    r = smol.post("/v1/chat/completions", json={**CHAT, **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_regex_by_structured_outputs_and_guided_regex_streamed_or_not(smol):
    text = content(smol, structured_outputs={"regex": DATE})
    assert re.fullmatch(DATE, text)
    assert content(smol, guided_regex=DATE) == text
    streamed = smol.post("/v1/chat/completions", json={**CHAT, "stream": True, "structured_outputs": {"regex": DATE}})
    assert "".join(re.findall(r'"content":"([^"]*)"', streamed.text)) == text
    r = smol.post("/v1/completions", json={"prompt": "The Second World War ended in the year", "max_tokens": 6,
                                           "temperature": 0, "guided_regex": r" \d{4}"})
    assert re.fullmatch(r" \d{4}", r.json()["choices"][0]["text"])


def test_choice_and_json_by_structured_outputs_and_guided_json(smol):
    assert content(smol, structured_outputs={"choice": ["1918", "1945"]}) in ("1918", "1945")
    for form in ({"structured_outputs": {"json": SCHEMA}}, {"guided_json": SCHEMA},
                 {"structured_outputs": {"json": json.dumps(SCHEMA)}}):
        assert set(json.loads(content(smol, **form))) == {"year"}, form


@pytest.mark.parametrize("bad,words", [
    ({"structured_outputs": {"grammar": "root ::= 'a'"}}, "grammar is not supported"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one of"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "not guided_regex and response_format"),
    ({"guided_regex": "(a"}, "not a valid regular expression"),
    ({"guided_regex": ""}, "non-empty"), ({"guided_choice": []}, "non-empty list"),
    ({"guided_json": "{not json"}, "is not JSON"),
    ({"guided_grammar": "root ::= 'a'"}, "guided_grammar is not supported"),  # vLLM's
    ({"grammar": "root ::= \"a\""}, "grammar is not supported"),  # llama.cpp's
    ({"structural_tag": {"type": "structural_tag"}}, "structural_tag is not supported")])
def test_wrong_ways_are_refused_by_name(smol, bad, words):
    r = smol.post("/v1/chat/completions", json={**CHAT, **bad})
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


def test_a_grammar_on_a_raw_completion_is_refused_not_ignored(smol):
    r = smol.post("/v1/completions", json={"prompt": "Say a", "max_tokens": 2, "grammar": "root ::= \"a\""})
    assert r.status_code == 400 and r.json()["error"]["param"] == "grammar", r.text


def test_a_pattern_no_token_can_finish_is_a_400_and_the_server_goes_on(smol):
    r = smol.post("/v1/chat/completions", json={**CHAT, "guided_regex": "(?!)"})
    assert r.status_code == 400 and "matches no text at all" in r.json()["error"]["message"]
    r = smol.post("/v1/chat/completions", json={**CHAT, "guided_regex": "a(?!b)b"})  # "a", then nothing may follow
    assert r.status_code == 400 and "no token of the vocabulary continues" in r.json()["error"]["message"], r.text
    streamed = smol.post("/v1/chat/completions", json={**CHAT, "guided_regex": "a(?!b)b", "stream": True}).text
    assert '"error"' in streamed and "invalid_request_error" in streamed
    assert re.fullmatch(DATE, content(smol, guided_regex=DATE))
