"""The OpenAI routes and the raw token stream through a live server on Gemma 3 270M (sliding-window layers)."""

from __future__ import annotations

import httpx
import pytest
from openai import OpenAI

from kvtool import SamplingParams
from kvtool.engine import Engine

pytestmark = pytest.mark.real_model

ASK = [{"role": "system", "content": "Answer in a few words."}, {"role": "user", "content": "Name a colour."}]


def test_chat_stream_and_usage_through_the_openai_client(gemma3, gemma_server):
    client = OpenAI(base_url=gemma_server.base_url + "/v1", api_key="unused", max_retries=0)
    name = client.models.list().data[0].id
    assert name.startswith("gemma-3-270m")
    out = client.chat.completions.create(model=name, messages=ASK, temperature=0, max_tokens=8)
    prompt = gemma3.encode_chat(ASK)
    want = Engine(gemma3).generate(prompt, SamplingParams(temperature=0, max_tokens=8)).run()
    assert out.choices[0].message.content == want.text.strip() or out.choices[0].message.content == want.text
    assert out.usage.prompt_tokens == len(prompt) and out.usage.completion_tokens == len(want.token_ids)
    chunks = list(client.chat.completions.create(model=name, messages=ASK, temperature=0, max_tokens=8, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == out.choices[0].message.content
    again = client.chat.completions.create(model=name, messages=ASK, temperature=0, max_tokens=8)
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # the prefix cache served the repeated prompt


def test_raw_token_stream_shows_gemma_turn_tokens(gemma3, gemma_server, sse_events):
    with httpx.Client(base_url=gemma_server.base_url, timeout=300) as client:
        with client.stream("POST", "/v1/chat/completions/raw", json={"stream": True, "messages": ASK,
                                                                      "temperature": 0, "max_tokens": 24}) as r:
            assert r.status_code == 200, r.read()
            events = sse_events(r)
        template = client.get("/v1/chat/template").json()["chat_template"]
    tokens, summary = events[:-2], events[-2]
    assert events[-1] == "[DONE]"
    assert all(set(t) == {"id", "piece", "channel", "t_ms"} for t in tokens)
    assert [t["piece"] for t in tokens] == [gemma3.decode([t["id"]]) for t in tokens]
    if summary["finish_reason"] == "stop":  # the model ended its turn: the raw stream shows the token that did
        assert tokens[-1]["piece"] == "<end_of_turn>" and tokens[-1]["channel"] == "special"
    assert summary["usage"]["completion_tokens"] == len(tokens)
    assert template == gemma3.chat_template and "<start_of_turn>" in template
