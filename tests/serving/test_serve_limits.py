"""Sizes and odd values a fuzzer found: every one is a clear 4xx, answered before any costly work."""

from __future__ import annotations

import json
import time

import httpx
import pytest

pytestmark = pytest.mark.real_model

USER = [{"role": "user", "content": "Hi"}]


def chat(**fields):
    return {"messages": USER, "max_tokens": 2, **fields}


def still_serving(client):
    assert client.get("/health").json()["status"] == "ok"
    r = client.post("/v1/chat/completions", json=chat(temperature=0))
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]


def error_of(r, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


@pytest.fixture(scope="module")
def small_limit(smollm2):
    from tests.serving.conftest import start_server

    srv = start_server(smollm2, default_max_tokens=2, max_body_bytes=4000)
    yield srv
    srv.stop()


def test_a_body_over_the_limit_is_a_413_that_says_how_to_raise_it(small_limit):
    with httpx.Client(base_url=small_limit.base_url, timeout=60) as client:
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x" * 5000}]})
        err = error_of(r, 413)
        assert "4000 bytes" in err["message"] and "--max-body-bytes" in err["message"]
        assert err["type"] == "invalid_request_error" and err["code"] == "request_too_large"
        assert client.post("/v1/cache/pin", json={"prompt": "y" * 5000}).status_code == 413
        still_serving(client)  # a body under the limit still works


def test_a_chunked_body_over_the_limit_is_a_413(small_limit):
    def chunks():  # no Content-Length: the limit is counted as the body arrives
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(10):
            yield b"z" * 1000
        yield b'"}]}'

    with httpx.Client(base_url=small_limit.base_url, timeout=60) as client:
        r = client.post("/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
        assert "limit of 4000 bytes" in error_of(r, 413)["message"]
        still_serving(client)


def test_a_prompt_no_context_window_can_hold_is_refused_without_tokenizing(smol, smollm2, monkeypatch):
    from kvtool.serving.served import max_piece_chars

    most = smollm2.context_window * max_piece_chars(smollm2.tokenizer)
    huge = "hello " * (most // 6 + 10)
    calls = []
    encode = type(smollm2.tokenizer).encode
    monkeypatch.setattr(type(smollm2.tokenizer), "encode",
                        lambda self, text, *a, **k: calls.append(len(text)) or encode(self, text, *a, **k))
    for path, body in [("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}], "max_tokens": 2}),
                       ("/v1/completions", {"prompt": huge, "max_tokens": 2}),
                       ("/tokenize", {"prompt": huge}),
                       ("/v1/cache/pin", {"prompt": huge}),
                       ("/v1/viz/render", {"prompt": huge})]:
        err = error_of(smol.post(path, json=body), 400)
        assert "context window of 8192 tokens" in err["message"] and f"at most {most} characters" in err["message"]
        assert err.get("code", "context_length_exceeded") == "context_length_exceeded"
    assert not [n for n in calls if n >= most], "a prompt that cannot fit was tokenized"
    monkeypatch.undo()
    still_serving(smol)


def test_health_answers_while_a_prompt_is_tokenized(smol_server, smollm2, monkeypatch):
    """Rendering and tokenizing run off the event loop: a tokenization that blocks stalls no other request.
    The tokenizer waits until /health has answered; on the event loop it would block /health (a timeout)."""
    import threading

    encode = type(smollm2.tokenizer).encode
    entered, release = threading.Event(), threading.Event()

    def blocking(self, text, *args, **kwargs):
        if "slowly" in text:
            entered.set()
            release.wait(30)
        return encode(self, text, *args, **kwargs)

    monkeypatch.setattr(type(smollm2.tokenizer), "encode", blocking)
    out = {}
    for path, body in [("/v1/chat/completions", chat(messages=[{"role": "user", "content": "slowly"}])),
                       ("/v1/completions", {"prompt": "slowly", "max_tokens": 2}), ("/tokenize", {"prompt": "slowly"}),
                       ("/v1/cache/pin", {"prompt": "slowly " * 20})]:
        entered.clear(), release.clear()
        t = threading.Thread(target=lambda: out.setdefault(path, httpx.post(smol_server.base_url + path, json=body,
                                                                              timeout=120)))
        t.start()
        assert entered.wait(60), path
        try:
            assert httpx.get(smol_server.base_url + "/health", timeout=10).status_code == 200, path
        finally:
            release.set()
        t.join()
        assert out[path].status_code == 200, out[path].text
    monkeypatch.undo()
    assert httpx.post(smol_server.base_url + "/v1/cache/unpin", json={"prompt": "slowly " * 20}).status_code == 200


def test_pin_longer_than_the_context_window_is_refused_before_computing(smol, monkeypatch):
    from kvtool.cache.manager import PrefixCache

    def no_compute(self, ids):
        raise AssertionError("pin computed KV for a prefix no request can use")

    monkeypatch.setattr(PrefixCache, "pin", no_compute)
    for body in [{"token_ids": [100 + i % 5000 for i in range(9000)]}, {"token_ids": [100] * 8192},
                 {"prompt": " hello" * 9001}]:
        err = error_of(smol.post("/v1/cache/pin", json=body), 400)
        assert "context window is 8192 tokens" in err["message"] and "at most 8191" in err["message"]
        assert err["code"] == "context_length_exceeded"
    monkeypatch.undo()
    still_serving(smol)


@pytest.mark.parametrize("key", ["\u00b2", "1" * 5000, "-1", "1.5", "٣"])
def test_logit_bias_key_that_is_not_a_token_id(smol, key):
    for path, body in [("/v1/chat/completions", chat(logit_bias={key: 5})),
                       ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "logit_bias": {key: 5}})]:
        err = error_of(smol.post(path, json=body), 400)
        assert err["param"] == "logit_bias" and "logit_bias" in err["message"] and key[:40] in err["message"]
        assert len(err["message"]) < 300
    still_serving(smol)


SURROGATE = [
    ("/v1/cache/pin", {"prompt": "\ud800" * 40}, "prompt"),
    ("/v1/cache/unpin", {"prompt": "\ud800" * 40}, "prompt"),
    ("/v1/cache/pin", {"messages": [{"role": "system", "content": "ok" + "\ud800" * 50}]}, "messages[0].content"),
    ("/v1/cache/unpin", {"messages": [{"role": "system", "content": "\ud800"}]}, "messages[0].content"),
    ("/v1/viz/render", {"prompt": "\ud800"}, "prompt"),
    ("/v1/viz/render", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content"),
    ("/v1/viz/generate", {"prompt": "\ud800", "max_tokens": 4}, "prompt"),
    ("/v1/viz/generate", {"messages": [{"role": "user", "content": "a\ud800"}], "max_tokens": 4},
     "messages[0].content"),
]


@pytest.mark.parametrize("path,body,where", SURROGATE, ids=[f"{p} {w}" for p, _, w in SURROGATE])
def test_lone_surrogate_is_the_chat_routes_400(smol, path, body, where):
    r = smol.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    message = error_of(r, 400)["message"]
    assert message.startswith(f"{where} contains an unpaired UTF-16 surrogate at character "), message
    assert "send valid Unicode text" in message
    same = chat(messages=[{"role": "user", "content": "\ud800"}])
    chat_r = smol.post("/v1/chat/completions", content=json.dumps(same), headers={"content-type": "application/json"})
    assert "unpaired UTF-16 surrogate" in error_of(chat_r, 400)["message"]


def test_viz_generate_refuses_ids_outside_the_vocab(smol):
    for ids in ([-1], [10**9], [2**70]):
        r = smol.post("/v1/viz/generate", json={"ids": ids, "max_tokens": 4})
        assert r.status_code == 400 and "token ids must be in [0, " in r.json()["error"]["message"], r.text
    assert smol.post("/v1/viz/tokens", json={"ids": [-1]}).json()["error"]["message"].startswith(
        "token ids must be in [0, ")
    still_serving(smol)


@pytest.mark.parametrize("seed", [2**70, -(2**70), 2**64])
def test_viz_generate_validates_the_seed_as_chat_does(smol, seed):
    r = smol.post("/v1/viz/generate", json={"prompt": "Hi", "seed": seed, "max_tokens": 4, "temperature": 1})
    assert "seed" in error_of(r, 400)["message"]
    assert "seed" in error_of(smol.post("/v1/chat/completions", json=chat(seed=seed)), 400)["message"]


def test_viz_generate_accepts_the_edges_of_the_seed_range(smol, sse_events):
    for seed in (2**64 - 1, -(2**63)):
        with smol.stream("POST", "/v1/viz/generate",
                         json={"prompt": "Hi", "seed": seed, "max_tokens": 2, "temperature": 1}) as r:
            events = sse_events(r)
        types = [e["type"] for e in events[:-1]]
        assert types[0] == "start" and types[-1] == "done" and events[-1] == "[DONE]", events


def test_viz_generate_is_one_request_of_the_batch(smol):
    """The inspector's stream goes through the worker as chat does: a chat request sent while it streams starts
    at the next step, instead of waiting for the whole stream to end (as when it ran alone on the worker)."""
    body = {"prompt": "1, 2, 3, 4, 5,", "max_tokens": 160, "temperature": 0}
    with smol.stream("POST", "/v1/viz/generate", json=body) as r:
        events = (json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {"))
        assert next(events)["type"] == "start" and next(events)["type"] == "token"
        chat_r = smol.post("/v1/chat/completions", json=chat(max_tokens=4))
        rest = list(events)
    assert chat_r.status_code == 200, chat_r.text
    waited, done = chat_r.json()["timings"]["queue_ms"], rest[-1]
    assert done["type"] == "done" and done["timings"]["decode_tokens"] > 100, done  # still streaming long after
    assert waited < done["timings"]["decode_ms"] / 4, (waited, done["timings"])


def test_viz_generate_stream_reports_a_failure_as_an_error_event(smol, sse_events, monkeypatch):
    from kvtool.serving.core import KvtoolCore

    def boom(self, *args, **kwargs):
        raise RuntimeError("generator exploded")

    monkeypatch.setattr(KvtoolCore, "step", boom)
    with smol.stream("POST", "/v1/viz/generate", json={"prompt": "Hi", "max_tokens": 2}) as r:
        assert r.status_code == 200
        events = sse_events(r)
    monkeypatch.undo()
    assert events[-1] == "[DONE]" and events[-2]["type"] == "error"
    assert "generator exploded" in events[-2]["message"]
    still_serving(smol)


def test_deeply_nested_body_says_so(smol):
    deep = b'{"messages": ' + b"[" * 3000 + b"]" * 3000 + b"}"
    for path in ("/v1/chat/completions", "/v1/cache/pin", "/v1/viz/render"):
        r = smol.post(path, content=deep, headers={"content-type": "application/json"})
        assert "nested too deeply" in error_of(r, 400)["message"], path
    still_serving(smol)


def test_pin_for_another_model_is_a_404_as_everywhere(smol):
    body = {"model": "nope", "prompt": "You are a helpful assistant. " * 8}
    for path in ("/v1/cache/pin", "/v1/cache/unpin"):
        err = error_of(smol.post(path, json=body), 404)
        assert "'nope'" in err["message"] and err["type"] == "not_found_error" and err["code"] == "model_not_found"
    assert error_of(smol.post("/v1/chat/completions", json=chat(model="nope")), 404)["code"] == "model_not_found"
    assert error_of(smol.post("/v1/cache/pin", json={**body, "model": 5}), 400)["param"] == "model"
    assert smol.post("/v1/cache/pin", json={**body, "model": "default"}).status_code == 200
    assert smol.post("/v1/cache/unpin", json={**body, "model": "default"}).status_code == 200


def test_an_error_that_echoes_a_lone_surrogate_is_still_utf8_json(smol):
    from kvtool.serving.errors import error_body

    body = b'{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "logit_bias": {"\\ud800": "x"}}'
    r = smol.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "logit_bias" in json.loads(r.content.decode("utf-8"))["error"]["message"]
    err = error_body(400, "messages.\ud800: bad", "messages.\ud800")["error"]
    assert json.dumps(err, ensure_ascii=False).encode("utf-8") and err["param"] == "messages.\\ud800"
