"""vLLM's and llama.cpp's ways to structure the output on a live server with SmolLM2: structured_outputs (json,
regex, choice, grammar, json_object), guided_regex / guided_json / guided_grammar, llama.cpp's grammar and
json_schema, response_format; one way per request, each refused clearly when wrong; tool calls forced by
tool_choice follow the tool's schema, and --tool-parser none leaves calls in the content."""

from __future__ import annotations

import json
import re

import httpx
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


def test_grammars_lark_and_gbnf_by_every_field(smol):
    gbnf = 'root ::= "The war ended in " [0-9] [0-9] [0-9] [0-9] "."'
    lark = 'start: "The war ended in " /[0-9]{4}/ "."'
    texts = {content(smol, **form) for form in ({"guided_grammar": lark}, {"grammar": gbnf},
                                                {"structured_outputs": {"grammar": gbnf}})}
    assert len(texts) == 1 and re.fullmatch(r"The war ended in \d{4}\.", texts.pop())
    r = smol.post("/v1/completions", json={"prompt": "The Second World War ended in the year", "max_tokens": 6,
                                           "temperature": 0, "grammar": 'root ::= " " [0-9]+'})
    assert r.status_code == 200 and re.fullmatch(r" \d+", r.json()["choices"][0]["text"]), r.text


def test_json_schema_by_llama_cpp_fields_and_openai_strict(smol):
    forms = ({"json_schema": SCHEMA}, {"response_format": {"type": "json_object", "schema": SCHEMA}},
             {"response_format": {"type": "json_schema", "json_schema": {"name": "y", "strict": True,
                                                                         "schema": SCHEMA}}})
    for form in forms:
        assert set(json.loads(content(smol, **form))) == {"year"}, form
    ask = [{"role": "user", "content": "Give the year the Second World War ended as a JSON object."}]
    assert isinstance(json.loads(content(smol, messages=ask, structured_outputs={"json_object": True}, max_tokens=60)),
                      dict)  # asked for JSON: SmolLM2 closes the object well within max_tokens
    r = smol.post("/v1/completions", json={"prompt": "A JSON list of two colours:", "max_tokens": 30,
                                           "temperature": 0, "json_schema": {"type": "array", "items": {
                                               "type": "string"}, "minItems": 2, "maxItems": 2}})
    body = r.json()["choices"][0]
    assert body["finish_reason"] == "stop" and len(json.loads(body["text"])) == 2, r.text


@pytest.mark.parametrize("bad,words", [
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one of"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "not guided_regex and response_format"),
    ({"grammar": "root ::= 'a'", "guided_regex": "a"}, "not guided_regex and grammar"),
    ({"guided_regex": "(a"}, "regex parse error"),
    ({"guided_regex": ""}, "non-empty"), ({"guided_choice": []}, "non-empty list"),
    ({"guided_json": "{not json"}, "is not JSON"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "strict": True, "schema": {
        "type": "object", "not": {"required": ["a"]}}}}}, "schema uses not, which structured output does not"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "u", "strict": True, "schema": {
        "type": "array", "uniqueItems": True}}}}, "without strict, the rest of the schema is enforced"),
    ({"guided_json": {"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}}}, "'#/$defs/A' points to nothing"),
    ({"guided_grammar": "start: undefined_rule"}, "the grammar cannot be enforced"),
    ({"structural_tag": {"type": "structural_tag"}}, "structural_tag is not supported")])
def test_wrong_ways_are_refused_by_name(smol, bad, words):
    r = smol.post("/v1/chat/completions", json={**CHAT, **bad})
    assert r.status_code == 400 and words in r.text, r.text


TAGS = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                 "minItems": 2, "maxItems": 3, "uniqueItems": True}},
        "required": ["tags"], "additionalProperties": False}
TAGS_ASK = [{"role": "user", "content": "Give tags for a photo of a cat as JSON."}]


def test_without_strict_the_rest_is_enforced_and_the_rest_reported(smol, sse_events, caplog):
    fmt = {"type": "json_schema", "json_schema": {"name": "tags", "schema": TAGS}}
    with caplog.at_level("WARNING", logger="kvtool.serving"):
        r = smol.post("/v1/chat/completions", json={**CHAT, "messages": TAGS_ASK, "max_tokens": 40,
                                                    "response_format": fmt})
    assert r.status_code == 200 and r.headers["x-kvtool-unenforced"] == "uniqueItems", r.text
    body = r.json()
    assert body["timings"]["structured_output"] == {"strict": False, "unenforced": ["uniqueItems"]}
    if body["choices"][0]["finish_reason"] == "stop":  # what is enforced holds: 2-3 short strings
        tags = json.loads(body["choices"][0]["message"]["content"])["tags"]
        assert 2 <= len(tags) <= 3 and all(len(t) <= 12 for t in tags), tags
    assert "without uniqueItems (schema.properties.tags)" in caplog.text
    streamed = smol.post("/v1/chat/completions", json={**CHAT, "messages": TAGS_ASK, "max_tokens": 40, "stream": True,
                                                       "response_format": fmt})
    assert streamed.headers["x-kvtool-unenforced"] == "uniqueItems"
    last = [e for e in sse_events(streamed) if isinstance(e, dict) and e.get("timings")][-1]
    assert last["timings"]["structured_output"]["unenforced"] == ["uniqueItems"]
    r = smol.post("/v1/completions", json={"prompt": "Tags for a cat photo, as JSON:", "max_tokens": 30,
                                           "temperature": 0, "guided_json": TAGS})  # vLLM's field: no strict
    assert r.headers["x-kvtool-unenforced"] == "uniqueItems" and r.json()["timings"]["structured_output"][
        "unenforced"] == ["uniqueItems"], r.text
    strict = {**fmt, "json_schema": {**fmt["json_schema"], "strict": True}}
    r = smol.post("/v1/chat/completions", json={**CHAT, "messages": TAGS_ASK, "response_format": strict})
    assert r.status_code == 400 and "schema.properties.tags uses uniqueItems" in r.text, r.text
    whole = {**fmt, "json_schema": {"name": "y", "strict": True, "schema": SCHEMA}}
    r = smol.post("/v1/chat/completions", json={**CHAT, "response_format": whole})
    assert "x-kvtool-unenforced" not in r.headers
    assert r.json()["timings"]["structured_output"] == {"strict": True, "unenforced": []}


TOOL = {"type": "function", "function": {"name": "get_year", "parameters": {
    "type": "object", "properties": {"event": {"type": "string"}, "year": {"type": "integer"}},
    "required": ["event", "year"], "additionalProperties": False}}}
CALL = r'<tool_call>\n\{"name": "get_year", "arguments": \{"event": "WW2", "year": 1945\}\}\n</tool_call>'


def test_a_forced_tool_call_follows_the_tools_schema(qwen):  # SmolLM2's chat template has no tools
    for choice in ("required", {"type": "function", "function": {"name": "get_year"}}):
        r = qwen.post("/v1/chat/completions", json={**CHAT, "max_tokens": 40, "tools": [TOOL], "tool_choice": choice})
        out = r.json()["choices"][0]
        call = out["message"]["tool_calls"][0]["function"]
        assert out["finish_reason"] == "tool_calls" and call["name"] == "get_year", r.text
        assert set(json.loads(call["arguments"])) == {"event", "year"}, r.text


def test_a_forced_call_of_a_strict_tool_is_enforced_whole_or_refused(qwen):
    loose = {"type": "function", "function": {"name": "tag", "parameters": TAGS}}
    ask = {**CHAT, "messages": TAGS_ASK, "max_tokens": 40, "tool_choice": "required"}
    r = qwen.post("/v1/chat/completions", json={**ask, "tools": [loose]})
    assert r.status_code == 200 and r.headers["x-kvtool-unenforced"] == "uniqueItems", r.text
    assert r.json()["timings"]["structured_output"] == {"strict": False, "unenforced": ["uniqueItems"]}
    strict = {"type": "function", "function": {**loose["function"], "strict": True}}
    r = qwen.post("/v1/chat/completions", json={**ask, "tools": [strict]})
    assert r.status_code == 400 and "tool 'tag' is strict" in r.text and "uses uniqueItems" in r.text, r.text
    r = qwen.post("/v1/chat/completions", json={**ask, "tools": [{"type": "function", "function": {
        **TOOL["function"], "strict": True}}]})
    assert r.status_code == 200 and r.json()["timings"]["structured_output"] == {"strict": True, "unenforced": []}


def test_tool_parser_none_leaves_calls_in_the_content(qwen, qwen25):
    from kvtool.serving import ServerConfig, create_app
    from kvtool.serving.server import BackgroundServer

    body = {**CHAT, "max_tokens": 40, "tools": [TOOL], "guided_regex": CALL}
    parsed = qwen.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert parsed["tool_calls"][0]["function"]["name"] == "get_year" and not parsed["content"]
    srv = BackgroundServer(create_app(qwen25, server_config=ServerConfig(default_max_tokens=8,
                                                                         tool_parser="none"))).start()
    try:
        with httpx.Client(base_url=srv.base_url, timeout=300) as client:
            r = client.post("/v1/chat/completions", json=body)
            message = r.json()["choices"][0]["message"]
            assert not message.get("tool_calls") and re.fullmatch(CALL, message["content"]), r.text
            r = client.post("/v1/chat/completions", json={**CHAT, "tools": [TOOL], "tool_choice": "required"})
            assert r.status_code == 400 and "--tool-parser none" in r.text, r.text
    finally:
        srv.stop()


def test_a_pattern_no_token_can_finish_is_a_400_and_the_server_goes_on(smol):
    r = smol.post("/v1/chat/completions", json={**CHAT, "guided_regex": "(a"})
    assert r.status_code == 400
    streamed = smol.post("/v1/chat/completions", json={**CHAT, "guided_regex": "a(b", "stream": True})
    assert streamed.status_code == 400 or '"error"' in streamed.text
    assert re.fullmatch(DATE, content(smol, guided_regex=DATE))


@pytest.mark.parametrize("body,words", [
    ({"guided_regex": "[^\\s\\S]"}, "no text this model can write satisfies the grammar"),
    ({"guided_regex": "W\x14"}, "no text this model can write satisfies the grammar"),  # no SmolLM2 token has 0x14
    ({"guided_choice": ["W\x14", "a"]}, "choice 0 ('W\\x14') has the character U+0014, which no token")])
def test_output_the_model_cannot_write_is_a_400_before_the_stream(smol, body, words):
    r = smol.post("/v1/chat/completions", json={**CHAT, **body, "stream": True})
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text


def test_a_regex_keeps_to_the_matches_the_model_can_write(smol):
    assert content(smol, guided_regex="W\x14|Wa\U00050000|Wb") == "Wb"  # U+50000 starts with 0xf1: no token has it


def test_a_structured_request_is_set_up_off_the_event_loop(smol, monkeypatch):
    """While one request's grammar is being set up (held here), the server answers others; the grammar is
    compiled once for the request, not once per check."""
    import asyncio
    import threading

    from kvtool.engine import Engine
    from kvtool.structured import grammar

    held, release, seen = threading.Event(), threading.Event(), []
    real = Engine.constraint

    def slow(self, params, stop_ids):
        if not params.structured:
            return real(self, params, stop_ids)
        try:
            asyncio.get_running_loop()
            seen.append("event loop")
        except RuntimeError:
            seen.append("thread")
        held.set()
        assert release.wait(120)
        return real(self, params, stop_ids)

    monkeypatch.setattr(Engine, "constraint", slow)
    results = []
    slow_one = threading.Thread(target=lambda: results.append(smol.post(
        "/v1/chat/completions", json={**CHAT, "structured_outputs": {"regex": DATE}})))
    slow_one.start()
    try:
        assert held.wait(120)
        free = smol.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "temperature": 0})
        assert free.status_code == 200 and not results  # answered while the other one's setup is held
    finally:
        release.set()
        slow_one.join(120)
    assert seen == ["thread"] and results[0].status_code == 200 and re.fullmatch(DATE, results[0].json()[
        "choices"][0]["message"]["content"])

    compiles, matcher = [], grammar.LLMatcher

    class Counting:
        def __getattr__(self, name):
            return getattr(matcher, name)

        @staticmethod
        def validate_grammar_with_warnings(text):
            compiles.append(text)
            return matcher.validate_grammar_with_warnings(text)

    monkeypatch.setattr(grammar, "LLMatcher", Counting())
    grammar.compile_messages.cache_clear()
    monkeypatch.setattr(Engine, "constraint", real)
    assert content(smol, structured_outputs={"regex": r"\d{3}"}, n=2)
    assert len(compiles) == 1
