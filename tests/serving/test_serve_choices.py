"""n choices per request and several prompts per completion, on the real SmolLM2 behind a live server."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.real_model

MSGS = [{"role": "user", "content": "Write one sentence about the sea."}]
SAMPLED = {"temperature": 0.9, "top_p": 0.95, "max_tokens": 12}


def chat(client, **fields) -> dict:
    r = client.post("/v1/chat/completions", json={"messages": MSGS, **SAMPLED, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def test_n_seeded_choices_equal_single_requests_seeded_one_apart(smol):
    one = [chat(smol, seed=40 + i)["choices"][0]["message"]["content"] for i in range(3)]
    assert len(set(one)) > 1
    out = chat(smol, seed=40, n=3)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert [c["message"]["content"] for c in out["choices"]] == one
    single = chat(smol, seed=40)["usage"]
    usage = out["usage"]
    assert usage["prompt_tokens"] == single["prompt_tokens"]  # the prompt counts once
    assert usage["completion_tokens"] == sum(c["timings"]["decode_tokens"] for c in out["choices"])
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    # choices 1 and 2 started from choice 0's prompt KV
    assert [c["timings"]["prefill_tokens"] for c in out["choices"]][1:] == [0, 0]


def test_streamed_choices_interleave_by_index_and_end_with_one_usage(smol, sse_events):
    want = [c["message"]["content"] for c in chat(smol, seed=5, n=3)["choices"]]
    body = {"messages": MSGS, **SAMPLED, "seed": 5, "n": 3, "stream": True, "stream_options": {"include_usage": True}}
    with smol.stream("POST", "/v1/chat/completions", json=body) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1
    text, roles, finishes = {i: "" for i in range(3)}, [], []
    for c in chunks:
        for choice in c["choices"]:
            text[choice["index"]] += choice["delta"].get("content") or ""
            if choice["delta"].get("role"):
                roles.append(choice["index"])
            if choice["finish_reason"]:
                finishes.append(choice["index"])
    assert [text[i] for i in range(3)] == want
    assert sorted(roles) == sorted(finishes) == [0, 1, 2]
    usage = [c for c in chunks if c.get("usage")]
    assert len(usage) == 1 and usage[0] is chunks[-1] and usage[0]["choices"] == []


def test_completion_with_several_prompts_and_n(smol):
    prompts = ["The capital of France is", "One, two, three,"]
    params = {"temperature": 0.8, "max_tokens": 8}
    single = [[smol.post("/v1/completions", json={"prompt": p, **params, "seed": 3 + i}).json()["choices"][0]["text"]
               for i in range(2)] for p in prompts]
    r = smol.post("/v1/completions", json={"prompt": prompts, **params, "seed": 3, "n": 2})
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in out["choices"]] == single[0] + single[1]  # choice p * n + i
    lengths = [smol.post("/tokenize", json={"prompt": p}).json()["count"] for p in prompts]
    assert out["usage"]["prompt_tokens"] == sum(lengths)


def test_raw_token_stream_tags_each_token_with_its_choice(smol, sse_events):
    body = {"messages": MSGS, **SAMPLED, "seed": 9, "n": 2}
    with smol.stream("POST", "/v1/chat/completions/raw", json=body) as r:
        events = sse_events(r)
    tokens, summary = events[:-2], events[-2]
    assert {t["index"] for t in tokens} == {0, 1}
    assert summary["done"] and [c["index"] for c in summary["choices"]] == [0, 1]
    want = chat(smol, seed=9, n=2, raw_tokens=True)["choices"]
    for i in (0, 1):
        assert [t["id"] for t in tokens if t["index"] == i] == [t["id"] for t in want[i]["raw_tokens"]]
        assert sum(t["index"] == i for t in tokens) == summary["choices"][i]["timings"]["decode_tokens"]


def test_openai_client_gets_n_choices(smol_server):
    from openai import OpenAI

    client = OpenAI(base_url=smol_server.base_url + "/v1", api_key="unused", max_retries=0)
    out = client.chat.completions.create(model=client.models.list().data[0].id, messages=MSGS, n=2, seed=1,
                                         **SAMPLED)
    assert len(out.choices) == 2 and all(c.message.content for c in out.choices)
    assert out.usage.completion_tokens == sum(c.model_extra["timings"]["decode_tokens"] for c in out.choices)


def test_json_object_response_format_streams_one_json_object_per_choice(smol, sse_events):
    import json

    body = {"messages": [{"role": "user", "content": "Give a book as JSON with title and year."}], "max_tokens": 64,
            "temperature": 0, "response_format": {"type": "json_object"}}
    out = smol.post("/v1/chat/completions", json=body).json()
    assert out["choices"][0]["finish_reason"] == "stop"
    assert isinstance(json.loads(out["choices"][0]["message"]["content"]), dict)
    with smol.stream("POST", "/v1/chat/completions", json={**body, "stream": True, "n": 2}) as r:
        chunks = [e for e in sse_events(r) if e != "[DONE]"]
    text = {0: "", 1: ""}
    for c in chunks:
        for choice in c["choices"]:
            text[choice["index"]] += choice["delta"].get("content") or ""
    assert text[0] == text[1] == out["choices"][0]["message"]["content"]


def test_json_schema_response_format_follows_the_schema(smol_server):
    import json

    import jsonschema
    from openai import OpenAI

    schema = {"type": "object", "properties": {"title": {"type": "string"}, "year": {"type": "integer"}},
              "required": ["title", "year"], "additionalProperties": False}
    client = OpenAI(base_url=smol_server.base_url + "/v1", api_key="unused", max_retries=0)
    out = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=[{"role": "user", "content": "Name a famous novel."}],
        max_tokens=60, temperature=0, response_format={"type": "json_schema", "json_schema": {
            "name": "book", "schema": schema, "strict": True}})
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)
