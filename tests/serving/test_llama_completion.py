"""llama.cpp's native POST /completion on a live server with SmolLM2: n_predict, the three stop types,
structured output by `json_schema` and `grammar`, logit_bias in llama.cpp's forms, n_probs, the stream (events
with `stop`, no [DONE]) and 400s that name llama.cpp's field."""

from __future__ import annotations

import json

import jsonschema
import pytest

pytestmark = pytest.mark.real_model

PROMPT = "The capital of France is"
SUMMARY = {"content", "stop", "model", "prompt", "tokens_predicted", "tokens_evaluated", "tokens_cached", "stop_type",
           "stopping_word", "truncated", "timings", "generation_settings"}


def complete(smol, **body) -> dict:
    r = smol.post("/completion", json={"prompt": PROMPT, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_n_predict_ends_at_the_limit_with_llama_cpp_fields(smol, smollm2):
    out = complete(smol, n_predict=4, n_probs=2)
    assert SUMMARY <= set(out) and "choices" not in out and out["stop"] is True
    assert out["stop_type"] == "limit" and out["stopping_word"] == "" and out["tokens_predicted"] == 4
    assert out["tokens_evaluated"] == len(smollm2.tokenizer.encode(PROMPT)) and out["prompt"] == PROMPT
    assert out["content"].strip() and out["truncated"] is False
    timings = out["timings"]
    assert timings["predicted_n"] == 4 and timings["prompt_n"] + timings["cache_n"] == out["tokens_evaluated"]
    assert timings["prompt_ms"] > 0 and timings["predicted_per_second"] > 0
    settings = out["generation_settings"]
    assert settings["n_predict"] == 4 and settings["temperature"] == 0 and settings["n_probs"] == 2
    probs = out["completion_probabilities"]
    assert len(probs) == 4 and "".join(p["token"] for p in probs) == out["content"]
    assert all(len(p["top_logprobs"]) == 2 and p["top_logprobs"][0]["logprob"] >= p["logprob"] for p in probs)
    assert probs[0]["top_logprobs"][0]["id"] == probs[0]["id"]  # greedy: the likeliest token was drawn
    assert complete(smol, n_predict=-1)["generation_settings"]["n_predict"] == 8  # the server's --default-max-tokens


def test_n_predict_0_fills_the_prefix_cache_and_returns_nothing(smol):
    prompt = "The quick brown fox jumps over the lazy dog. " * 4
    smol.post("/v1/cache/reset")
    warm = complete(smol, prompt=prompt, n_predict=0)
    assert warm["content"] == "" and warm["tokens_predicted"] == 0 and warm["tokens_cached"] == 0
    assert warm["stop_type"] == "limit" and warm["timings"]["predicted_n"] == 0
    assert complete(smol, prompt=prompt, n_predict=1)["tokens_cached"] >= 16  # whole 16-token blocks of the prompt


def test_a_stop_word_and_the_end_of_turn(smol, smollm2):
    text = complete(smol, n_predict=6)["content"]
    word = text.split()[1]
    out = complete(smol, n_predict=6, stop=[word])
    assert out["stop_type"] == "word" and out["stopping_word"] == word and out["content"] == text[:text.index(word)]
    eos = smollm2.end_of_turn_ids()[0]
    ended = complete(smol, n_predict=6, logit_bias={str(eos): 100})
    assert ended["stop_type"] == "eos" and ended["content"] == "" and ended["tokens_predicted"] == 1


def test_logit_bias_false_bans_a_token_in_either_form(smol):
    first = complete(smol, n_predict=1, return_tokens=True)["tokens"][0]
    for bias in ([[first, False]], {str(first): False}):
        out = complete(smol, n_predict=1, return_tokens=True, logit_bias=bias)
        assert out["tokens"][0] != first and out["generation_settings"]["logit_bias"] == [[first, -100.0]], bias


def test_a_prompt_of_token_ids_or_mixed_reads_as_the_text(smol, smollm2):
    ids = smollm2.tokenizer.encode(PROMPT)
    text = complete(smol, n_predict=3)["content"]
    assert complete(smol, prompt=ids, n_predict=3)["content"] == text
    assert complete(smol, prompt=[*ids[:2], smollm2.tokenizer.decode(ids[2:])], n_predict=3)["content"] == text


def test_json_schema_output_validates(smol):
    schema = {"type": "array", "items": {"type": "string"}, "minItems": 2, "maxItems": 2}
    out = complete(smol, prompt="A JSON list of two colours:", n_predict=30, json_schema=schema)
    assert out["stop_type"] in ("eos", "limit"), out
    if out["stop_type"] == "eos":
        jsonschema.validate(json.loads(out["content"]), schema)


def test_a_gbnf_grammar_gives_one_of_its_words(smol):
    out = complete(smol, prompt="Is the sky blue? Answer:", n_predict=8, grammar='root ::= "yes" | "no"')
    assert out["content"] in ("yes", "no") and out["stop_type"] == "eos", out


def test_the_stream_is_llama_cpp_events_without_done(smol, sse_events):
    body = {"prompt": PROMPT, "temperature": 0, "n_predict": 5}
    whole = smol.post("/completion", json=body).json()
    with smol.stream("POST", "/completion", json={**body, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert "[DONE]" not in events and events[-1]["stop"] is True
    assert all(e["stop"] is False and set(e) >= {"content", "tokens"} for e in events[:-1])
    assert "".join(e["content"] for e in events[:-1]) == whole["content"]
    last = events[-1]
    assert SUMMARY <= set(last) and last["stop_type"] == "limit" and last["tokens_predicted"] == 5


@pytest.mark.parametrize("body,param,words", [
    ({"json_schema": {"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}}}, "json_schema", "points to "),
    ({"grammar": "root ::= undefined_rule"}, "grammar", "grammar"),
    ({"n_predict": "5"}, "n_predict", "n_predict"),
    ({"temperature": "hot"}, "temperature", "temperature"),
    ({"logit_bias": [[1, 2, 3]]}, "logit_bias", "logit_bias"),
    ({"repeat_penalty": 0.0}, "repeat_penalty", "repeat_penalty=0.0"),
    ({"n_probs": 50}, "n_probs", "n_probs=50"),
    ({"n_predict": -2}, "n_predict", "n_predict must be"),
    ({"mirostat": 2}, "mirostat", "mirostat is not implemented"),
    ({"prompt": ["one", "two"]}, "prompt", "one prompt per request"),
    ({"prompt": ""}, None, "the prompt is empty"),
    ({"n_predict": 10 ** 6}, None, "+ n_predict (1000000)")])
def test_bad_fields_are_a_400_naming_the_field(smol, body, param, words):
    r = smol.post("/completion", json={"prompt": PROMPT, "n_predict": 2, **body})
    error = r.json()["error"]
    assert r.status_code == 400 and words in error["message"], r.text
    assert param is None or error["param"].startswith(param), r.text  # (a list item: logit_bias.0)


@pytest.mark.parametrize("path,body", [("/completion", {"prompt": PROMPT, "n_predict": 3}),
                                       ("/v1/completions", {"prompt": PROMPT, "max_tokens": 3}),
                                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                                 "max_tokens": 3})])
def test_every_event_of_a_stream_fits_the_documented_event_schema(smol, path, body):
    """/openapi.json documents each generating route's text/event-stream as events {data, event, id, retry}."""
    documented = smol.get("/openapi.json").json()["paths"][path]["post"]["responses"]["200"]["content"]
    event_schema = documented["text/event-stream"]["schema"]
    with smol.stream("POST", path, json={**body, "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200
        events = [{"data": line[len("data: "):]} for line in r.iter_lines() if line.startswith("data: ")]
    assert len(events) >= 2
    for event in events:
        jsonschema.validate(event, event_schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate("data: {}", event_schema)  # the whole body as one string is not an event
