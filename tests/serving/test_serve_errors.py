"""Every bad input gets an OpenAI-shaped 4xx naming the problem, and the server keeps serving."""

from __future__ import annotations

import time

import httpx
import pytest

pytestmark = pytest.mark.real_model

USER = [{"role": "user", "content": "Hi"}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def chat(**fields):
    return {"messages": USER, "max_tokens": 2, **fields}


BAD = [
    # (name, path, body, status, words the message must contain)
    ("malformed json", "/v1/chat/completions", b'{"messages": [', 400, "not valid JSON"),
    ("body not an object", "/v1/chat/completions", b"[1, 2]", 400, "must be a JSON object"),
    ("missing messages", "/v1/chat/completions", {"max_tokens": 2}, 400, "messages"),
    ("messages wrong type", "/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400, "at least one message"),
    ("unknown role", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "wizard"),
    ("content wrong type", "/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "content"),
    ("image content", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "text-only"),
    ("user without content", "/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "no content"),
    ("unknown model", "/v1/chat/completions", chat(model="gpt-4o"), 404, "gpt-4o"),
    ("temperature wrong type", "/v1/chat/completions", chat(temperature="hot"), 400, "temperature"),
    ("stream wrong type", "/v1/chat/completions", chat(stream="yes"), 400, "invalid request: stream:"),
    ("temperature out of range", "/v1/chat/completions", chat(temperature=-1), 400, "temperature"),
    ("top_p out of range", "/v1/chat/completions", chat(top_p=0), 400, "top_p"),
    ("top_k negative", "/v1/chat/completions", chat(top_k=-3), 400, "top_k"),
    ("min_p out of range", "/v1/chat/completions", chat(min_p=2), 400, "min_p"),
    ("presence penalty out of range", "/v1/chat/completions", chat(presence_penalty=5), 400, "presence_penalty"),
    ("frequency penalty out of range", "/v1/chat/completions", chat(frequency_penalty=-9), 400, "frequency_penalty"),
    ("max_tokens zero", "/v1/chat/completions", chat(max_tokens=0), 400, "max_tokens"),
    ("max_tokens float", "/v1/chat/completions", chat(max_tokens=1.5), 400, "max_tokens"),
    ("top_logprobs too many", "/v1/chat/completions", chat(logprobs=True, top_logprobs=50), 400, "logprobs"),
    ("top_logprobs without logprobs", "/v1/chat/completions", chat(top_logprobs=2), 400, "logprobs=true"),
    ("seed too large", "/v1/chat/completions", chat(seed=2**70), 400, "seed"),
    ("empty stop string", "/v1/chat/completions", chat(stop=[""]), 400, "stop"),
    ("n zero", "/v1/chat/completions", chat(n=0), 400, "n must be >= 1"),
    ("n past the server's capacity", "/v1/chat/completions", chat(n=1000), 400, "n=1000 = 1000 sequences"),
    ("prompts x n past the server's capacity", "/v1/completions", {"prompt": ["a", "b"], "n": 50, "max_tokens": 2},
     400, "2 prompt(s) x n=50"),
    ("over the context window", "/v1/chat/completions", chat(max_tokens=9000), 400, "context window"),
    ("tool message without a call", "/v1/chat/completions",
     {"messages": USER + [{"role": "tool", "tool_call_id": "call_9", "content": "sunny"}]}, 400, "call_9"),
    ("tool message with the wrong id", "/v1/chat/completions",
     {"messages": USER + [{"role": "assistant", "content": None, "tool_calls": [CALL]},
                          {"role": "tool", "tool_call_id": "call_2", "content": "sunny"}]}, 400, "call_2"),
    ("tool call left unanswered", "/v1/chat/completions",
     {"messages": USER + [{"role": "assistant", "content": None, "tool_calls": [CALL]},
                          {"role": "user", "content": "and?"}]}, 400, "no tool result"),
    ("tool call arguments not json", "/v1/chat/completions",
     {"messages": USER + [{"role": "assistant", "tool_calls": [
         {**CALL, "function": {"name": "get_weather", "arguments": "{city"}}]},
         {"role": "tool", "tool_call_id": "call_1", "content": "x"}]}, 400, "arguments"),
    ("tool name invalid", "/v1/chat/completions",
     chat(tools=[{"type": "function", "function": {"name": "bad name!"}}]), 400, "bad name!"),
    ("tool schema invalid", "/v1/chat/completions",
     chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]), 400,
     "JSON Schema"),
    ("tool schema not an object", "/v1/chat/completions",
     chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]), 400,
     "object"),
    ("tools duplicated", "/v1/chat/completions",
     chat(tools=[{"type": "function", "function": {"name": "f"}}] * 2), 400, "twice"),
    ("tool type unknown", "/v1/chat/completions",
     chat(tools=[{"type": "retrieval", "function": {"name": "f"}}]), 400, "function"),
    ("named tool_choice not declared", "/v1/chat/completions",
     chat(tools=[{"type": "function", "function": {"name": "f"}}],
          tool_choice={"type": "function", "function": {"name": "g"}}), 400, "'g'"),
    ("required without tools", "/v1/chat/completions", chat(tool_choice="required"), 400, "required"),
    ("tools on a model whose template ignores them", "/v1/chat/completions",
     chat(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "does not render tools"),
    ("reserved template kwarg", "/v1/chat/completions", chat(chat_template_kwargs={"tools": []}), 400, "tools"),
    ("continue without assistant last", "/v1/chat/completions",
     chat(continue_final_message=True, add_generation_prompt=False), 400, "assistant message last"),
    ("unpaired surrogate", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 1}', 400, "surrogate"),
    ("response_format unknown", "/v1/chat/completions", chat(response_format={"type": "grammar"}), 400,
     "'grammar' is not supported"),
    ("json_schema without a schema", "/v1/chat/completions",
     chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), 400, "json_schema.schema"),
    ("strict json_schema with not", "/v1/chat/completions",
     chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": {
         "type": "object", "properties": {"a": {"anyOf": [{"type": "string"}, {"not": {"type": "null"}}]}}}}}), 400,
     "schema.properties.a.anyOf[1] uses not"),
    ("json_schema with a dangling $ref", "/v1/chat/completions",
     chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
         "type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}}}}), 400, "'#/$defs/A' points to nothing"),
    ("json_schema strict not a flag", "/v1/chat/completions",
     chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "strict": "yes", "schema": {}}}), 400,
     "response_format.json_schema.strict must be true or false"),
    ("json_object that cannot end", "/v1/chat/completions",
     chat(response_format={"type": "json_object"}, ignore_eos=True), 400, "drop ignore_eos"),
    ("completion without prompt", "/v1/completions", {"max_tokens": 2}, 400, "prompt"),
    ("completion empty prompt", "/v1/completions", {"prompt": "", "max_tokens": 2}, 400, "empty"),
    ("completion token id out of range", "/v1/completions", {"prompt": [1, 10**9], "max_tokens": 2}, 400,
     "token ids"),
    ("completion, one bad prompt of several", "/v1/completions", {"prompt": [[1, 2], [10**9]], "max_tokens": 2},
     400, "token ids must be in"),
    ("completion over the window", "/v1/completions", {"prompt": "hi", "max_tokens": 10**12}, 400,
     "context window"),
    ("tokenize neither prompt nor messages", "/tokenize", {}, 400, "exactly one"),
    ("detokenize id out of range", "/detokenize", {"tokens": [-1]}, 400, "token ids"),
    ("detokenize wrong type", "/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("template unknown role", "/v1/chat/template", {"messages": [{"role": "robot", "content": "x"}]}, 400, "robot"),
    ("no such route", "/v1/embeddings", {"input": "x"}, 404, "no route"),
]


@pytest.mark.parametrize("name,path,body,status,words", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_a_clear_4xx(smol, name, path, body, status, words):
    if isinstance(body, bytes):
        r = smol.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = smol.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert words.lower() in err["message"].lower(), err["message"]
    assert err["type"] == ("not_found_error" if status == 404 else "invalid_request_error")


def test_body_that_is_not_json_says_so(smol):
    r = smol.post("/v1/chat/completions", content=b"messages=hi", headers={"content-type": "text/plain"})
    assert r.status_code == 400 and "Content-Type: application/json" in r.json()["error"]["message"]


def test_context_window_error_gives_the_numbers(smol):
    r = smol.post("/v1/chat/completions", json=chat(max_tokens=9000))
    err = r.json()["error"]
    assert "9000" in err["message"] and "8192" in err["message"] and err["code"] == "context_length_exceeded"


def test_server_keeps_serving_after_bad_input(smol):
    for _ in range(3):
        smol.post("/v1/chat/completions", content=b"{nope", headers={"content-type": "application/json"})
    assert smol.get("/health").json()["status"] == "ok"
    r = smol.post("/v1/chat/completions", json=chat(temperature=0))
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]


def test_api_key(smollm2):
    from fastapi.testclient import TestClient

    from kvtool.serving import ServerConfig, create_app

    with TestClient(create_app(smollm2, server_config=ServerConfig(api_key="s3cret"))) as client:
        r = client.get("/v1/models")
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert client.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert client.post("/tokenize", json={"prompt": "x"}).status_code == 401
        assert client.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert client.get("/health").status_code == 200  # health stays open for probes
        for path in ("/metrics", "/openapi.json", "/docs", "/redoc"):  # the rest, API docs included, need the key
            assert client.get(path).status_code == 401, path
            assert client.get(path, headers={"Authorization": "Bearer s3cret"}).status_code == 200, path
        schema = client.get("/openapi.json", headers={"Authorization": "Bearer s3cret"}).json()
        assert "401" in schema["paths"]["/v1/models"]["get"]["responses"]
        assert "401" not in schema["paths"]["/health"]["get"]["responses"]
    with TestClient(create_app(smollm2, server_config=ServerConfig(api_key="s3cret", metrics_open=True))) as client:
        assert client.get("/metrics").status_code == 200  # --metrics-open: a scraper needs no key
        assert client.get("/docs").status_code == 401


def test_full_queue_is_a_429_not_a_hang(smollm2):
    from kvtool.serving.server import BackgroundServer

    from kvtool.serving import ServerConfig, create_app

    app = create_app(smollm2, server_config=ServerConfig(max_active=1, max_queue=0))
    with BackgroundServer(app) as srv, httpx.Client(base_url=srv.base_url, timeout=60) as client:
        long = {"messages": USER, "max_tokens": 32, "stream": True}
        with client.stream("POST", "/v1/chat/completions", json=long) as first:
            assert first.status_code == 200
            r = client.post("/v1/chat/completions", json=chat())
            assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
            assert "1 sequences in flight" in r.json()["error"]["message"]
            assert "it holds at most 1 (--max-active 1 + --max-queue 0)" in r.json()["error"]["message"]
            assert r.headers["retry-after"] == "1"
        # Leaving the stream early disconnected the client: its slot frees up.
        deadline = time.monotonic() + 30
        while app.state.worker.running and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.post("/v1/chat/completions", json=chat()).status_code == 200


def test_a_request_whose_sampling_cannot_be_set_up_fails_alone(smol, monkeypatch):
    from kvtool.engine import Engine

    def boom(self, *args):
        raise RuntimeError("no vocabulary today")

    monkeypatch.setattr(Engine, "constraint", boom)
    r = smol.post("/v1/chat/completions", json=chat(response_format={"type": "json_object"}))
    assert r.status_code == 500 and "no vocabulary today" in r.json()["error"]["message"]
    monkeypatch.undo()
    ok = smol.post("/v1/chat/completions", json=chat(temperature=0))
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"]


def test_a_failed_batch_whose_requests_fail_to_end_leaves_the_server_serving(smol, monkeypatch):
    """The batched forward raises, and so does ending its requests: they get the error, the loop goes on."""
    from kvtool.engine.scheduler import BatchScheduler
    from kvtool.engine.step import StepExecutor

    def boom(self, *args, **kwargs):
        raise RuntimeError("step went down")

    real_cancel = BatchScheduler.cancel
    monkeypatch.setattr(StepExecutor, "run", boom)
    monkeypatch.setattr(BatchScheduler, "cancel", lambda self, gen, reason="abort", error=None:
                        boom(self) if reason == "error" else real_cancel(self, gen, reason, error))
    r = smol.post("/v1/chat/completions", json=chat(temperature=0))
    assert r.status_code == 500 and "step went down" in r.json()["error"]["message"]
    monkeypatch.undo()
    ok = smol.post("/v1/chat/completions", json=chat(temperature=0))
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"]
