"""/v1/chat/template renders exactly what apply_chat_template does, and flags every token."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.real_model

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
# Key order differs from the pydantic field order on purpose: the server must keep the client's bytes.
TIME = {"function": {"parameters": {"properties": {}, "type": "object"}, "name": "get_time"}, "type": "function"}
CALLS = [{"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
         {"id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather and time in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": CALLS},
    {"role": "tool", "tool_call_id": "call_a", "content": '{"sky": "sunny"}'},
    {"role": "tool", "tool_call_id": "call_b", "content": "14:05"},
]


def as_template_input(messages):
    """What HF templates expect: arguments as objects, content never None."""
    out = []
    for m in messages:
        m = {**m, "content": m["content"] or ""}
        if "tool_calls" in m:
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                               for c in m["tool_calls"]]
        out.append(m)
    return out


def test_tool_conversation_equals_apply_chat_template(qwen, qwen25):
    r = qwen.post("/v1/chat/template", json={"messages": CONVERSATION, "tools": [WEATHER, TIME]})
    assert r.status_code == 200, r.text
    body = r.json()
    expected = qwen25.tokenizer.apply_chat_template(as_template_input(CONVERSATION), tools=[WEATHER, TIME],
                                                    tokenize=False, add_generation_prompt=True)
    assert body["prompt"] == expected
    assert body["token_ids"] == qwen25.tokenizer.encode(expected, add_special_tokens=False)
    assert body["count"] == len(body["tokens"]) == len(body["token_ids"]) and body["prefill"] == ""
    assert "".join(t["piece"] for t in body["tokens"]) == expected
    tokenized = qwen.post("/tokenize", json={"messages": CONVERSATION, "tools": [WEATHER, TIME]}).json()
    assert tokenized["tokens"] == body["token_ids"]


def test_token_flags(qwen):
    tokens = qwen.post("/v1/chat/template", json={"messages": CONVERSATION, "tools": [WEATHER]}).json()["tokens"]
    by_piece = {}
    for t in tokens:
        by_piece.setdefault(t["piece"], t)
    assert by_piece["<|im_start|>"]["special"] and by_piece["<|im_start|>"]["role_marker"]
    assert by_piece["<|im_end|>"]["special"] and by_piece["<|im_end|>"]["role_marker"]
    assert by_piece["<tool_call>"]["tool_call"] and not by_piece["<tool_call>"]["special"]  # added, not special
    call_text = "".join(t["piece"] for t in tokens if t["tool_call"])
    assert '"get_weather"' in call_text and '"get_time"' in call_text and "sunny" not in call_text
    response_text = "".join(t["piece"] for t in tokens if t["tool_response"])
    assert "sunny" in response_text and "14:05" in response_text and "get_weather" not in response_text
    role_text = "".join(t["piece"] for t in tokens if t["role_marker"])
    assert "assistant" in role_text and "Weather" not in role_text
    assert not any(t["think"] for t in tokens)


def test_think_flags_and_template_kwargs(qwen):
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<think>\nhmm"}]
    body = qwen.post("/v1/chat/template", json={
        "messages": msgs, "add_generation_prompt": False, "continue_final_message": True,
        "chat_template_kwargs": {"enable_thinking": False}}).json()
    assert body["prompt"].endswith("<|im_start|>assistant\n<think>\nhmm")
    think = "".join(t["piece"] for t in body["tokens"] if t["think"])
    assert think == "<think>\nhmm"


def test_forced_tool_choice_prefill_and_call_schema_are_shown(qwen):
    named = {"type": "function", "function": {"name": "get_weather"}}
    body = qwen.post("/v1/chat/template", json={
        "messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": [WEATHER], "tool_choice": named}).json()
    assert body["prefill"] == "<tool_call>\n"  # the call's JSON is then written in JSON schema mode
    assert body["prompt"].endswith("<|im_start|>assistant\n" + body["prefill"])
    assert body["call_schema"]["properties"] == {"name": {"enum": ["get_weather"]},
                                                 "arguments": WEATHER["function"]["parameters"]}
    loose = {"type": "function", "function": {"name": "get_weather", "parameters": {  # does not compile at all
        "type": "object", "properties": {"city": {"$ref": "#/$defs/city"}}}}}
    body = qwen.post("/v1/chat/template", json={
        "messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": [loose], "tool_choice": named}).json()
    assert body["prefill"] == '<tool_call>\n{"name": "get_weather", "arguments": ' and body["call_schema"] is None


def test_get_raw_template(qwen, qwen25):
    body = qwen.get("/v1/chat/template").json()
    assert body["chat_template"] == qwen25.chat_template and "<tool_call>" in body["chat_template"]
