"""POST /v1/responses on real models through the official `openai` client: text and instructions (the same
tokens as the chat route), kvtool's timings and raw tokens, previous_response_id served from the prefix cache,
store=false, a streamed function call and its follow-up, and clear errors for what is not served."""

from __future__ import annotations

import json

import openai
import pytest
from openai import OpenAI

pytestmark = pytest.mark.real_model

WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather for a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
RULES = "You are a careful assistant. " + " ".join(f"Rule {i}: answer briefly and politely." for i in range(20))


def client(server) -> OpenAI:
    return OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_text_with_instructions_is_the_chat_answer(smol_server):
    oai = client(smol_server)
    name = oai.models.list().data[0].id
    out = oai.responses.create(model=name, input="Name three colors.", instructions="Answer in one line.",
                               max_output_tokens=4, temperature=0, extra_body={"raw_tokens": True})
    chat = oai.chat.completions.create(model=name, temperature=0, max_tokens=4, messages=[
        {"role": "system", "content": "Answer in one line."}, {"role": "user", "content": "Name three colors."}])
    assert out.output_text == chat.choices[0].message.content and out.output_text
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.usage.output_tokens == 4 and out.usage.input_tokens == chat.usage.prompt_tokens
    assert [item.type for item in out.output] == ["message"] and out.output[0].role == "assistant"
    extra = out.model_extra
    assert extra["timings"]["decode_tokens"] == 4 and extra["timings"]["ttft_ms"] > 0
    assert len(extra["raw_tokens"]) == 4 and {"id", "piece", "channel", "t_ms"} <= set(extra["raw_tokens"][0])


def test_previous_response_id_extends_the_cached_prompt(qwen_server, qwen):
    oai = client(qwen_server)
    first = oai.responses.create(input="Name a color.", instructions=RULES, max_output_tokens=12, temperature=0)
    again = oai.responses.create(input="Name another one.", instructions=RULES, previous_response_id=first.id,
                                 max_output_tokens=12, temperature=0)
    assert first.usage.input_tokens > 200 and again.previous_response_id == first.id
    # the follow-up's prompt is the stored conversation rendered token for token, then the new turn
    turns = [{"role": "system", "content": RULES}, {"role": "user", "content": "Name a color."}]
    before = qwen.post("/tokenize", json={"messages": turns}).json()["tokens"]
    turns += [{"role": "assistant", "content": first.output_text}, {"role": "user", "content": "Name another one."}]
    after = qwen.post("/tokenize", json={"messages": turns}).json()["tokens"]
    assert len(before) == first.usage.input_tokens and len(after) == again.usage.input_tokens
    assert after[:len(before)] == before
    # so every whole 16-token block of the first prompt (the prefix cache's unit) is a hit
    assert again.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens // 16 * 16
    assert oai.responses.retrieve(first.id).output_text == first.output_text


def test_store_false_is_not_kept(smol_server):
    oai = client(smol_server)
    out = oai.responses.create(input="Hi", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError, match="store=false"):
        oai.responses.retrieve(out.id)
    with pytest.raises(openai.NotFoundError, match="store=false") as err:
        oai.responses.create(input="Again", previous_response_id=out.id, max_output_tokens=2)
    assert err.value.body["param"] == "previous_response_id"


def test_stream_a_function_call_then_answer_its_result(qwen_server):
    oai = client(qwen_server)
    with oai.responses.stream(model=oai.models.list().data[0].id, input="What is the weather in Paris right now?",
                              tools=[WEATHER], temperature=0, max_output_tokens=40) as stream:
        kinds = [ev.type for ev in stream]
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    call_events = ["response.output_item.added", "response.function_call_arguments.delta",
                   "response.function_call_arguments.done", "response.output_item.done"]
    assert [k for k in kinds if k in call_events] == call_events
    call = final.output[-1]
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert json.loads(call.arguments) == {"city": "Paris"} and call.call_id.startswith("call_")
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 C"}
    # tool_choice none: the 0.5B model would call again; the stored call and its result render as chat turns. Its
    # generation_config's repetition_penalty 1.05 has greedy Qwen2.5-Coder-0.5B write the call again as text: off
    answer = oai.responses.create(model=final.model, input=[result], tools=[WEATHER], tool_choice="none",
                                  previous_response_id=final.id, temperature=0, max_output_tokens=30,
                                  extra_body={"repetition_penalty": 1.0})
    assert answer.output[0].type == "message" and "24" in answer.output_text


def test_text_format_json_schema(qwen_server):
    schema = {"type": "object", "properties": {"color": {"type": "string"}}, "required": ["color"],
              "additionalProperties": False}
    out = client(qwen_server).responses.create(input="Name a color as JSON.", max_output_tokens=30, temperature=0,
                                               text={"format": {"type": "json_schema", "name": "c", "schema": schema}})
    assert set(json.loads(out.output_text)) == {"color"}


BAD = [({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
       ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
       ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
       ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
       ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
       ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
       ({"input": "hi", "max_output_tokens": "many"}, "max_output_tokens"),
       ({"input": "hi", "tool_choice": "sometimes"}, "tool_choice"),
       ({}, "input")]


@pytest.mark.parametrize("body,param", BAD, ids=[p for _, p in BAD])
def test_bad_input_is_a_clear_400(smol, body, param):
    r = smol.post("/v1/responses", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and param.split("[")[0].split(".")[0] in r.json()["error"]["message"]


def test_unknown_previous_response_is_a_404(smol):
    r = smol.post("/v1/responses", json={"input": "hi", "previous_response_id": "resp_nope"})
    assert r.status_code == 404 and "resp_nope" in r.json()["error"]["message"]
    assert smol.get("/v1/responses/resp_nope").status_code == 404


def test_text_format_strict_or_lenient_as_on_chat(smol):
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True, "maxItems": 3}
    fmt = {"type": "json_schema", "name": "ids", "schema": schema}
    r = smol.post("/v1/responses", json={"input": "Three ids as JSON.", "max_output_tokens": 16, "temperature": 0,
                                         "text": {"format": fmt}})
    assert r.status_code == 200, r.text
    assert r.headers["x-kvtool-unenforced"] == "uniqueItems"
    assert r.json()["timings"]["structured_output"] == {"strict": False, "unenforced": ["uniqueItems"]}
    r = smol.post("/v1/responses", json={"input": "Three ids as JSON.", "max_output_tokens": 16,
                                         "text": {"format": {**fmt, "strict": True}}})
    assert r.status_code == 400 and "uniqueItems" in r.json()["error"]["message"]
