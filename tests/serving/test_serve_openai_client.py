"""The official `openai` package against live servers on loopback with the real GGUF models."""

from __future__ import annotations

import json

import pytest
from openai import OpenAI


pytestmark = pytest.mark.real_model

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"}},
                   "required": ["city"]}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris right now?"}]
THINKER = [{"role": "system", "content": "You always think step by step inside <think> and </think> tags first, "
                                         "then give the final answer after the closing tag."},
           {"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def smol_client(smol_server):
    return OpenAI(base_url=smol_server.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def qwen_client(qwen_server):
    return OpenAI(base_url=qwen_server.base_url + "/v1", api_key="unused", max_retries=0)


def model_id(client) -> str:
    return client.models.list().data[0].id


def test_models_chat_and_stream(smol_client):
    name = model_id(smol_client)
    assert name.startswith("SmolLM2")
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    out = smol_client.chat.completions.create(model=name, messages=msgs, temperature=0, max_tokens=12)
    assert "Paris" in out.choices[0].message.content and out.choices[0].finish_reason in ("stop", "length")
    assert out.usage.prompt_tokens > 0 and out.usage.completion_tokens > 0
    assert 0 <= out.usage.prompt_tokens_details.cached_tokens < out.usage.prompt_tokens
    assert out.model_extra["timings"]["ttft_ms"] > 0
    stream = smol_client.chat.completions.create(model=name, messages=msgs, temperature=0, max_tokens=12,
                                                 stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == out.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens


def test_tool_call_round_trip(qwen_client):
    name = model_id(qwen_client)
    first = qwen_client.chat.completions.create(model=name, messages=ASK_WEATHER, tools=[WEATHER], temperature=0,
                                                max_tokens=40)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    history = ASK_WEATHER + [choice.message.model_dump(exclude_none=True),
                             {"role": "tool", "tool_call_id": call.id,
                              "content": json.dumps({"city": "Paris", "temperature_c": 18, "sky": "sunny"})}]
    # tool_choice="none": answer from the result now (Qwen2.5-Coder-0.5B re-calls while tools are in the prompt);
    # plain greedy: with its card's repetition_penalty 1.05 this 0.5B model writes its call again as text
    final = qwen_client.chat.completions.create(model=name, messages=history, tools=[WEATHER], tool_choice="none",
                                                temperature=0, max_tokens=24, extra_body={"repetition_penalty": 1.0})
    answer = final.choices[0]
    assert answer.finish_reason in ("stop", "length") and not answer.message.tool_calls
    assert "18" in answer.message.content or "sunny" in answer.message.content.lower(), answer.message.content


def test_streamed_tool_call_deltas(qwen_client):
    stream = qwen_client.chat.completions.create(model=model_id(qwen_client), messages=ASK_WEATHER, tools=[WEATHER],
                                                 temperature=0, max_tokens=40, stream=True,
                                                 stream_options={"include_usage": True})
    calls, finish, usage = {}, None, None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for tc in choice.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                if tc.id:
                    assert entry["id"] is None, "id is sent once"
                    entry["id"] = tc.id
                if tc.function.name:
                    entry["name"] = tc.function.name
                entry["arguments"] += tc.function.arguments or ""
    assert finish == "tool_calls" and usage is not None
    assert calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"]) == {"city": "Paris"}


def test_named_tool_choice_forces_the_call(qwen_client):
    out = qwen_client.chat.completions.create(
        model=model_id(qwen_client), messages=[{"role": "user", "content": "Tell me about Oslo."}],
        tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=0,
        max_tokens=24)
    assert out.choices[0].finish_reason == "tool_calls"
    call = out.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)


BOOK = {"type": "function", "function": {
    "name": "book_table", "description": "Book a restaurant table",
    "parameters": {"type": "object", "properties": {
        "restaurant": {"type": "string"}, "people": {"type": "integer"},
        "time": {"type": "string", "enum": ["lunch", "dinner"]}}, "required": ["restaurant", "people", "time"]}}}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "book_table"}}])
def test_forced_calls_follow_the_tools_schema(qwen_client, choice):
    import jsonschema

    out = qwen_client.chat.completions.create(
        model=model_id(qwen_client), tools=[WEATHER, BOOK], tool_choice=choice, temperature=0, max_tokens=60,
        messages=[{"role": "user", "content": "Get me a table for four at Chez Anna tonight."}])
    assert out.choices[0].finish_reason == "tool_calls"
    call = out.choices[0].message.tool_calls[0]
    schema = {"get_weather": WEATHER, "book_table": BOOK}[call.function.name]["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    if choice != "required":  # named: its own parameters, so the enum and the integer hold
        assert call.function.name == "book_table"


def test_a_forced_call_cannot_also_take_a_response_format(qwen):
    r = qwen.post("/v1/chat/completions", json={
        "messages": ASK_WEATHER, "tools": [WEATHER], "tool_choice": "required", "max_tokens": 8,
        "response_format": {"type": "json_object"}})
    assert r.status_code == 400 and "tool_choice" in r.json()["error"]["message"]


def test_tool_choice_none_answers_in_text(qwen_client):
    out = qwen_client.chat.completions.create(model=model_id(qwen_client), messages=ASK_WEATHER, tools=[WEATHER],
                                              tool_choice="none", temperature=0, max_tokens=8)
    assert out.choices[0].finish_reason in ("stop", "length") and not out.choices[0].message.tool_calls
    assert out.choices[0].message.content


def test_reasoning_split_from_a_think_block(qwen_client):
    out = qwen_client.chat.completions.create(model=model_id(qwen_client), messages=THINKER, temperature=0,
                                              max_tokens=24)
    msg = out.choices[0].message
    reasoning = msg.model_extra["reasoning_content"]
    assert "4" in reasoning and "<think>" not in reasoning and "</think>" not in (msg.content or "")
    assert "<think>" not in (msg.content or "")
    assert out.usage.completion_tokens_details.reasoning_tokens > 0


def test_reasoning_when_the_prompt_opens_the_think_block(qwen_client):
    """An assistant prefix `<think>\\n` (continue_final_message): the output starts inside reasoning."""
    stream = qwen_client.chat.completions.create(
        model=model_id(qwen_client), messages=THINKER + [{"role": "assistant", "content": "<think>\n"}],
        temperature=0, max_tokens=24, stream=True,
        extra_body={"continue_final_message": True, "add_generation_prompt": False, "raw_tokens": True})
    reasoning, content, raw = "", "", []
    for chunk in stream:
        raw += chunk.model_extra.get("raw_tokens") or []
        for choice in chunk.choices:
            reasoning += choice.delta.model_extra.get("reasoning_content") or ""
            content += choice.delta.content or ""
    assert "4" in reasoning and "think>" not in reasoning + content
    pieces = "".join(t["piece"] for t in raw)
    assert "</think>" in pieces, "the raw stream shows the closing tag exactly as produced"
    assert raw[-1]["piece"] == "<|im_end|>" and raw[-1]["channel"] == "special"
    assert {t["channel"] for t in raw[:-1]} == {"reasoning"}


def test_parse_fills_a_pydantic_model(smol_client):
    from tests.test_json_pydantic import City

    out = smol_client.chat.completions.parse(
        model=model_id(smol_client), response_format=City, temperature=0, max_tokens=150,
        messages=[{"role": "user", "content": "Describe Paris and two cities near it as JSON."}])
    city = out.choices[0].message.parsed
    assert isinstance(city, City) and out.choices[0].finish_reason == "stop"
    assert city.country.value == "France" and len(city.neighbours) <= 2


def test_a_forced_call_follows_a_pydantic_tool(qwen_client):
    import openai

    from tests.test_json_pydantic import City

    tool = openai.pydantic_function_tool(City, name="save_city")
    assert "$defs" in tool["function"]["parameters"]  # the nested models arrive as references
    out = qwen_client.chat.completions.create(
        model=model_id(qwen_client), tools=[tool], tool_choice={"type": "function", "function": {"name": "save_city"}},
        temperature=0, max_tokens=120, messages=[{"role": "user", "content": "Save Paris with two neighbours."}])
    call = out.choices[0].message.tool_calls[0]
    assert out.choices[0].finish_reason == "tool_calls" and call.function.name == "save_city"
    City.model_validate_json(call.function.arguments)
