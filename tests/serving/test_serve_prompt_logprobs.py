"""echo and prompt logprobs on a live server with the real SmolLM2: the scores that lm-eval-style
loglikelihood requests read, checked against the logprobs of the tokens the model generated itself."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.real_model

PROMPT = "The capital of France is"


def test_echoed_continuation_scores_equal_the_generated_tokens_logprobs(smol):
    gen = smol.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 5, "temperature": 0,
                                             "logprobs": 0}).json()
    made = gen["choices"][0]["logprobs"]["token_logprobs"]
    ids = smol.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    cont = smol.post("/tokenize", json={"prompt": gen["choices"][0]["text"], "add_special_tokens": False}).json()
    assert len(cont["tokens"]) == 5  # the text re-encodes to the same 5 tokens
    r = smol.post("/v1/completions", json={"prompt": ids + cont["tokens"], "max_tokens": 1, "temperature": 0,
                                           "echo": True, "logprobs": 1})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    n = len(ids) + 5
    assert choice["text"].startswith(PROMPT) and len(lp["tokens"]) == n + 1  # the prompt, then one new token
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][len(ids):n] == pytest.approx(made, abs=2e-3)
    assert all(len(top) >= 1 for top in lp["top_logprobs"][1:])
    echoed = smol.post("/detokenize", json={"tokens": ids + cont["tokens"]}).json()["prompt"]
    assert choice["text"].startswith(echoed) and lp["text_offset"][n] == len(echoed)  # the new token's text follows
    assert lp["text_offset"] == sorted(lp["text_offset"])
    assert "prompt_logprobs" not in choice  # only when asked for by name
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # scored: prefilled whole


def test_streamed_echo_starts_with_the_prompt(smol, sse_events):
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "echo": True, "stream": True}
    with smol.stream("POST", "/v1/completions", json=body) as r:
        chunks = [e for e in sse_events(r) if e != "[DONE]"]
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert texts[0] == PROMPT and chunks[0]["choices"][0]["logprobs"] is None
    plain = smol.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "temperature": 0}).json()
    assert "".join(texts) == PROMPT + plain["choices"][0]["text"]


def test_chat_prompt_logprobs_cover_the_rendered_template(smol):
    msgs = [{"role": "user", "content": "Name a colour."}]
    r = smol.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 3, "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    out = r.json()
    rows = out["choices"][0]["prompt_logprobs"]
    ids = smol.post("/tokenize", json={"messages": msgs}).json()["tokens"]
    assert len(rows) == len(ids) == out["usage"]["prompt_tokens"] and rows[0] is None
    for tok, row in zip(ids[1:], rows[1:]):
        own = row[str(tok)]
        assert own["logprob"] <= 0 and own["rank"] >= 1 and own["decoded_token"]
        assert 2 <= len(row) <= 3 and {e["rank"] for e in row.values()} >= {1, 2}
    with smol.stream("POST", "/v1/chat/completions", json={"messages": msgs, "max_tokens": 3, "prompt_logprobs": 0,
                                                         "stream": True}) as s:
        lines = [line for line in s.iter_lines() if "prompt_logprobs" in line]
    assert len(lines) == 1  # on the chunk with the finish_reason


def test_bad_prompt_logprobs_is_a_400(smol):
    r = smol.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 50})
    assert r.status_code == 400 and "prompt_logprobs" in r.json()["error"]["message"]


def test_completions_take_a_response_format(smol):
    import json

    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    r = smol.post("/v1/completions", json={"prompt": "A JSON object describing a dog:", "max_tokens": 40,
                                           "temperature": 0, "response_format": {
                                               "type": "json_schema", "json_schema": {"name": "dog", "schema": schema}}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and set(json.loads(choice["text"])) == {"name", "age"}
