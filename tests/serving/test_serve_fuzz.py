"""Property-based fuzz of the HTTP API (hypothesis): whatever a client sends, never a 5xx."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.real_model

# Integers a fuzzer may put anywhere: all either tiny (cheap to generate) or far out of range.
INTS = [-(2**70), -1, 0, 1, 2, 3, 2**31, 2**64, 10**30]
scalar = (st.none() | st.booleans() | st.sampled_from(INTS) | st.floats(allow_nan=False, width=32)
          | st.text(max_size=12) | st.sampled_from(["", "auto", "none", "required", "function", "user", "\ud800"]))
value = st.recursive(scalar, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                             max_size=3), max_leaves=6)
ROLES = st.sampled_from(["system", "developer", "user", "assistant", "tool", "bogus", ""])
CALL = st.fixed_dictionaries({"id": st.sampled_from(["call_1", "call_2", ""]), "type": st.just("function"),
                              "function": st.fixed_dictionaries({"name": st.sampled_from(["f", "g"]),
                                                                 "arguments": st.sampled_from(['{"a": 1}', "{", "[]",
                                                                                               ""])})})
MESSAGE = st.fixed_dictionaries(
    {"role": ROLES},
    optional={"content": st.none() | st.text(max_size=30) | st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url"]), "text": st.text(max_size=10)}), max_size=2) | value,
              "tool_calls": st.lists(CALL, max_size=2), "tool_call_id": st.sampled_from(["call_1", "call_2", "x"]),
              "name": st.text(max_size=5)})
TOOL = st.fixed_dictionaries({"type": st.sampled_from(["function", "other"]), "function": st.fixed_dictionaries(
    {"name": st.sampled_from(["f", "g", "bad name"])},
    optional={"parameters": st.sampled_from([{"type": "object", "properties": {}}, {"type": "objekt"},
                                             {"type": "string"}]) | value, "description": st.text(max_size=10)})})
PATTERN = st.sampled_from(["(?!)", "a(?!b)b", "\\d{2}", "(", "[^\\s\\S]", "x*"]) | st.text(max_size=6)
SCHEMA = st.sampled_from([{"type": "object", "properties": {"a": {"type": "string", "pattern": "^(?!x)x"}}},
                          {"$ref": "#/$defs/A", "$defs": {"A": {"$ref": "#/$defs/A"}}}, {"anyOf": []},
                          {"type": "object", "properties": {"n": {"type": "number", "minimum": 2, "maximum": 1}}}])
GEN_FIELDS = {"model": value, "max_tokens": value, "temperature": value, "top_p": value, "top_k": value,
              "min_p": value, "seed": value, "stop": value, "presence_penalty": value, "frequency_penalty": value,
              "repetition_penalty": value, "stream": st.booleans() | value, "stream_options": value, "n": value,
              "stop_token_ids": value, "ignore_eos": st.booleans(), "guided_choice": value,
              "guided_regex": PATTERN | value, "guided_json": SCHEMA | value, "logit_bias": value, "min_tokens": value,
              "structured_outputs": st.dictionaries(st.sampled_from(["json", "regex", "choice", "grammar"]),
                                                    PATTERN | SCHEMA | value, max_size=2) | value}
CHAT_FIELDS = {**GEN_FIELDS, "messages": st.lists(MESSAGE, max_size=4) | value, "tools": st.lists(TOOL, max_size=2),
               "tool_choice": value, "parallel_tool_calls": value, "logprobs": value, "top_logprobs": value,
               "max_completion_tokens": value, "chat_template_kwargs": value, "add_generation_prompt": value,
               "continue_final_message": value, "raw_tokens": value, "response_format": value}
ENDPOINTS = {
    "/v1/chat/completions": ({"messages": [{"role": "user", "content": "Hi"}]}, CHAT_FIELDS),
    "/v1/chat/completions/raw": ({"messages": [{"role": "user", "content": "Hi"}]}, CHAT_FIELDS),
    "/v1/completions": ({"prompt": "Hello"}, {**GEN_FIELDS, "prompt": value | st.lists(st.sampled_from(INTS)),
                                              "logprobs": value, "echo": value, "suffix": value}),
    "/tokenize": ({"prompt": "Hello"}, {"prompt": value, "messages": st.lists(MESSAGE, max_size=3),
                                        "add_special_tokens": value, "with_pieces": value, "tools": value}),
    "/detokenize": ({"tokens": [1, 2]}, {"tokens": value | st.lists(st.sampled_from(INTS)), "with_pieces": value}),
    "/v1/chat/template": ({"messages": [{"role": "user", "content": "Hi"}]},
                          {"messages": st.lists(MESSAGE, max_size=4), "tools": st.lists(TOOL, max_size=2),
                           "tool_choice": value, "chat_template_kwargs": value, "continue_final_message": value}),
}


@st.composite
def requests(draw):
    path = draw(st.sampled_from(sorted(ENDPOINTS)))
    base, fields = ENDPOINTS[path]
    body = dict(base)
    for key in draw(st.lists(st.sampled_from(sorted(fields)), max_size=4, unique=True)):
        if draw(st.integers(0, 4)) == 0:
            body.pop(key, None)
        else:
            body[key] = draw(fields[key])
    if draw(st.integers(0, 15)) == 0:  # sometimes not JSON at all, or not an object
        return path, draw(st.sampled_from([b"{", b"[]", b"null", b'"x"', b"{\"messages\": [}", b"\xff\xfe"]))
    return path, json.dumps(body).encode()


@pytest.fixture(scope="module")
def client(smollm2):
    from fastapi.testclient import TestClient

    from kvtool.serving import ServerConfig, create_app

    with TestClient(create_app(smollm2, server_config=ServerConfig(default_max_tokens=2)),
                    raise_server_exceptions=False) as c:
        yield c


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(req=requests())
def test_no_request_gets_a_5xx(client, req):
    path, body = req
    r = client.post(path, content=body, headers={"content-type": "application/json"})
    assert r.status_code < 500, (path, body, r.text)
    if r.status_code >= 400:
        err = r.json()["error"]
        assert err["message"] and err["type"]
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text, (path, body, r.text)


def test_still_serving_after_the_fuzz(client):
    assert client.get("/health").json()["status"] == "ok"
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1})
    assert r.status_code == 200
