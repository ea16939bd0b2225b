"""The API's contract on a real model (SmolLM2): stop strings are capped with a clear 400, max_tokens=0 with
echo scores the prompt as vLLM does, and the OpenAPI schema says what the server does: 400 (never 422)
with kvtool's error object, and the limits it checks (empty messages or prompt, stop caps, max_tokens)."""

from __future__ import annotations

import time

import pytest

from kvtool.serving.protocol import MAX_STOP_CHARS, MAX_STOP_STRINGS

pytestmark = pytest.mark.real_model


def test_too_many_or_too_long_stop_strings_are_a_quick_400(smol):
    start = time.perf_counter()
    r = smol.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4,
                                           "stop": [f"s{i}" for i in range(10_000)]})
    assert r.status_code == 400 and time.perf_counter() - start < 10
    err = r.json()["error"]
    assert err["param"] == "stop" and f"at most {MAX_STOP_STRINGS} are allowed" in err["message"]
    r = smol.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                "stop": "x" * (MAX_STOP_CHARS + 1)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"
    assert f"at most {MAX_STOP_CHARS} are allowed" in r.json()["error"]["message"]
    at_cap = smol.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2,
                                                "stop": ["y" * MAX_STOP_CHARS] * MAX_STOP_STRINGS})
    assert at_cap.status_code == 200, at_cap.text


def test_max_tokens_0_with_echo_returns_the_scored_prompt_and_no_completion(smol, smollm2, sse_events):
    prompt = "The capital of France is Paris"
    ids = smollm2.tokenizer.encode(prompt)
    out = smol.post("/v1/completions", json={"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1}).json()
    choice = out["choices"][0]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    lps = choice["logprobs"]
    assert len(lps["tokens"]) == len(ids) and lps["token_logprobs"][0] is None
    assert all(lp <= 0 for lp in lps["token_logprobs"][1:])
    assert out["usage"]["completion_tokens"] == 0 and out["usage"]["prompt_tokens"] == len(ids)
    # the same scores as the prompt part of an echo with a completion
    longer = smol.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "echo": True, "logprobs": 1,
                                                "temperature": 0}).json()["choices"][0]["logprobs"]
    assert longer["token_logprobs"][1:len(ids)] == pytest.approx(lps["token_logprobs"][1:], abs=1e-4)
    with smol.stream("POST", "/v1/completions", json={"prompt": prompt, "max_tokens": 0, "echo": True,
                                                      "stream": True}) as r:
        events = sse_events(r)
    chunks = [e for e in events if isinstance(e, dict) and e["choices"]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == prompt
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and events[-1] == "[DONE]"
    r = smol.post("/v1/completions", json={"prompt": prompt, "max_tokens": 0})
    assert r.status_code == 400 and "echo=true" in r.json()["error"]["message"]


@pytest.mark.parametrize("path,body,why", [
    ("/v1/chat/completions", {"messages": []}, "messages is empty"),
    ("/v1/completions", {"prompt": ""}, "the prompt is empty"),
    ("/v1/completions", {"prompt": [[]]}, "the prompt is empty"),
])
def test_empty_inputs_are_refused_as_the_schema_says(smol, path, body, why):
    r = smol.post(path, json=body)
    assert r.status_code == 400 and why in r.json()["error"]["message"]


def test_the_schema_declares_400_with_the_error_object_and_the_limits(smol):
    doc = smol.get("/openapi.json").json()
    text = str(doc)
    assert "'422'" not in text and "HTTPValidationError" not in text
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            if "requestBody" in op:
                assert op["responses"]["400"]["content"]["application/json"]["schema"] == \
                    {"$ref": "#/components/schemas/ErrorResponse"}, (method, path)
    error = doc["components"]["schemas"]["ErrorResponse"]
    assert error["required"] == ["error"]
    schemas = doc["components"]["schemas"]
    chat, completion = schemas["ChatCompletionRequest"]["properties"], schemas["CompletionRequest"]["properties"]
    assert chat["messages"]["minItems"] == 1 and chat["max_tokens"]["minimum"] == 1
    assert completion["max_tokens"]["minimum"] == 0
    assert {"minLength": 1, "type": "string"} in completion["prompt"]["anyOf"]
    stop_list = [b for b in completion["stop"]["anyOf"] if b.get("type") == "array"][0]
    assert stop_list["maxItems"] == MAX_STOP_STRINGS and stop_list["items"]["maxLength"] == MAX_STOP_CHARS
    generating = doc["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert {"200", "400", "413", "429", "503"} <= set(generating)
