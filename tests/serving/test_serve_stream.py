"""Wire format on SmolLM2: chat chunks exactly as OpenAI sends them, raw tokens, completions, tokenize."""

from __future__ import annotations

import time

import pytest

pytestmark = pytest.mark.real_model

ASK = [{"role": "user", "content": "What is the capital of France?"}]
TIMING_KEYS = {"queue_ms", "ttft_ms", "prefill_tokens", "prefill_ms", "decode_tokens", "decode_tokens_per_s"}


def stream(client, sse_events, path="/v1/chat/completions", **body):
    with client.stream("POST", path, json={"stream": True, **body}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return sse_events(r)


def test_chat_stream_chunks_follow_openai(smol, sse_events):
    events = stream(smol, sse_events, messages=ASK, temperature=0, max_tokens=6,
                    stream_options={"include_usage": True})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    assert all(set(c) >= {"id", "object", "created", "model", "choices", "usage"} for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    body, finish, usage = chunks[1:-2], chunks[-2], chunks[-1]
    assert all(c["usage"] is None and c["choices"][0]["finish_reason"] is None for c in body)
    assert all(set(c["choices"][0]["delta"]) == {"content"} for c in body)
    assert finish["choices"][0]["delta"] == {} and finish["choices"][0]["finish_reason"] == "length"
    assert TIMING_KEYS <= set(finish["timings"])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    cached = usage["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert set(usage["usage"]["prompt_tokens_details"]) == {"cached_tokens"}
    assert 0 <= cached < usage["usage"]["prompt_tokens"]
    text = "".join(c["choices"][0]["delta"]["content"] for c in body)
    full = smol.post("/v1/chat/completions", json={"messages": ASK, "temperature": 0, "max_tokens": 6}).json()
    assert full["choices"][0]["message"]["content"] == text, "streaming and non-streaming agree"
    assert full["object"] == "chat.completion" and TIMING_KEYS <= set(full["timings"])


def test_no_usage_chunk_unless_asked(smol, sse_events):
    chunks = stream(smol, sse_events, messages=ASK, max_tokens=2)[:-1]
    assert all("usage" not in c for c in chunks) and chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_stop_finish_reason_and_stop_strings(smol):
    out = smol.post("/v1/chat/completions", json={"messages": ASK, "temperature": 0, "max_tokens": 30}).json()
    assert out["choices"][0]["finish_reason"] == "stop" and "Paris" in out["choices"][0]["message"]["content"]
    out = smol.post("/v1/chat/completions", json={"messages": ASK, "temperature": 0, "max_tokens": 30,
                                                  "stop": ["Paris"]}).json()
    assert out["choices"][0]["finish_reason"] == "stop" and "Paris" not in out["choices"][0]["message"]["content"]


def test_raw_token_stream_shows_special_tokens(smol, sse_events):
    events = stream(smol, sse_events, "/v1/chat/completions/raw", messages=ASK, temperature=0, max_tokens=30)
    tokens, summary = events[:-2], events[-2]
    assert events[-1] == "[DONE]"
    assert all(set(t) == {"id", "piece", "channel", "t_ms"} for t in tokens)
    assert tokens[-1]["piece"] == "<|im_end|>" and tokens[-1]["channel"] == "special"
    assert {t["channel"] for t in tokens[:-1]} == {"content"}
    assert [t["t_ms"] for t in tokens] == sorted(t["t_ms"] for t in tokens)
    assert summary["finish_reason"] == "stop" and summary["usage"]["completion_tokens"] == len(tokens)
    assert TIMING_KEYS <= set(summary["timings"])


def test_raw_tokens_opt_in_on_chat_stream_and_logprobs(smol, sse_events):
    events = stream(smol, sse_events, messages=ASK, temperature=0, max_tokens=4, raw_tokens=True, logprobs=True,
                    top_logprobs=2)
    chunks = [c for c in events[1:-1] if c["choices"]]
    raw = [t for c in chunks for t in c.get("raw_tokens", [])]
    lps = [lp for c in chunks for lp in (c["choices"][0]["logprobs"] or {}).get("content", [])]
    assert len(raw) == len(lps) == 4
    assert [lp["token"] for lp in lps] == [t["piece"] for t in raw]
    assert all(len(lp["top_logprobs"]) == 2 and lp["logprob"] <= 0 for lp in lps)
    assert lps[0]["top_logprobs"][0]["logprob"] >= lps[0]["logprob"] - 1e-6  # greedy picks the top token


def test_sampling_with_a_seed_is_reproducible(smol):
    body = {"messages": ASK, "temperature": 1.0, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "seed": 7,
            "max_completion_tokens": 8, "presence_penalty": 0.5, "frequency_penalty": 0.5}
    a, b = (smol.post("/v1/chat/completions", json=body).json() for _ in range(2))
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
    assert a["usage"]["completion_tokens"] == 8


def test_completions_string_ids_and_stream(smol, sse_events):
    out = smol.post("/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 3,
                                             "temperature": 0, "logprobs": 1}).json()
    assert out["object"] == "text_completion" and out["choices"][0]["text"].strip().startswith("Paris")
    lp = out["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == 3 and lp["text_offset"][0] == 0
    ids = smol.post("/tokenize", json={"prompt": "The capital of France is"}).json()["tokens"]
    again = smol.post("/v1/completions", json={"prompt": ids, "max_tokens": 3, "temperature": 0}).json()
    assert again["choices"][0]["text"] == out["choices"][0]["text"]
    events = stream(smol, sse_events, "/v1/completions", prompt="The capital of France is", max_tokens=3,
                    temperature=0, stream_options={"include_usage": True})
    assert "".join(c["choices"][0]["text"] for c in events[:-1] if c["choices"]) == out["choices"][0]["text"]
    assert events[-2]["usage"]["completion_tokens"] == 3 and "timings" in events[-3]


def test_completions_stream_a_chunk_per_token_when_its_text_is_held_back(smol, smollm2, sse_events):
    # a forced byte token 0xE4 starts a 3-byte character: the decoder holds it, and each token still gets its chunk
    byte = smollm2.tokenizer.convert_tokens_to_ids("\u00e4")  # GPT-2's byte table: byte 0xE4 spells itself
    body = {"prompt": "Say:", "max_tokens": 3, "temperature": 0, "logit_bias": {str(byte): 100}}
    events = stream(smol, sse_events, "/v1/completions", **body, stream_options={"include_usage": True})
    tokens = [c for c in events[:-1] if c["choices"] and c["choices"][0]["finish_reason"] is None]
    assert len(tokens) == 3 and tokens[0]["choices"][0]["text"] == ""
    whole = smol.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert "".join(c["choices"][0]["text"] for c in events[:-1] if c["choices"]) == whole
    assert events[-2]["usage"]["completion_tokens"] == 3


def test_tokenize_detokenize_round_trip(smol):
    r = smol.post("/tokenize", json={"prompt": "Hello world", "with_pieces": True, "return_token_strs": True}).json()
    assert r["count"] == len(r["tokens"]) == len(r["pieces"]) == len(r["token_strs"]) and r["max_model_len"] == 8192
    assert "".join(r["pieces"]) == "Hello world"
    back = smol.post("/detokenize", json={"tokens": r["tokens"], "with_pieces": True}).json()
    assert back["prompt"] == "Hello world" and back["pieces"] == r["pieces"]
    chat = smol.post("/tokenize", json={"messages": ASK}).json()
    rendered = smol.post("/v1/chat/template", json={"messages": ASK}).json()
    assert chat["tokens"] == rendered["token_ids"]


def test_models_and_health(smol):
    models = smol.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["object"] == "model"
    assert models["data"][0]["precision"] == "float32"
    name = models["data"][0]["id"]
    assert smol.post("/v1/chat/completions", json={"model": name, "messages": ASK, "max_tokens": 1}).status_code == 200
    assert smol.get("/health").json() == {"status": "ok", "model": name, "running": 0, "waiting": 0}
    paths = smol.get("/openapi.json").json()["paths"]
    assert {"/v1/chat/completions", "/v1/chat/completions/raw", "/v1/completions", "/tokenize", "/detokenize",
            "/v1/chat/template", "/v1/models"} <= set(paths)


def test_client_disconnect_stops_generation(smol, smol_server):
    worker = smol_server.app.state.worker
    finished_before = dict(smol_server.app.state.metrics.finish)
    with smol.stream("POST", "/v1/chat/completions",
                     json={"messages": ASK, "stream": True, "max_tokens": 500, "ignore_eos": True}) as r:
        for line in r.iter_lines():
            if '"content"' in line and '"role"' not in line:
                break  # one token arrived: hang up mid-stream
    deadline = time.monotonic() + 30
    while worker.running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert worker.running == 0 and worker.waiting == 0
    aborted = smol_server.app.state.metrics.finish[("abort",)] - finished_before.get(("abort",), 0)
    assert aborted == 1, "the generation was closed (its KV freed), not run to max_tokens"


def test_client_disconnect_stops_a_non_streaming_generation(smol_server):
    import httpx

    worker, metrics = smol_server.app.state.worker, smol_server.app.state.metrics
    aborted_before = metrics.finish[("abort",)]
    body = {"messages": ASK, "max_tokens": 500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=smol_server.base_url, timeout=2.0) as client:
        client.post("/v1/chat/completions", json=body)  # gives up after 2 s and closes the connection
    deadline = time.monotonic() + 30
    while worker.running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert worker.running == 0 and metrics.finish[("abort",)] == aborted_before + 1


def test_metrics_after_traffic(smol):
    text = smol.get("/metrics").text
    for name in ("kvtool_http_responses_total{route=\"/v1/chat/completions\",status=\"200\"}",
                 "kvtool_time_to_first_token_seconds_bucket", "kvtool_inter_token_latency_seconds_count",
                 "kvtool_generation_tokens_total", "kvtool_requests_running 0"):
        assert name in text
    counters = dict(line.split() for line in text.splitlines() if line.startswith("kvtool_scheduler_"))
    assert int(counters["kvtool_scheduler_steps_total"]) > 0
    assert float(counters["kvtool_scheduler_host_seconds_total"]) > 0


def test_metrics_hook_adds_lines(smollm2):
    from fastapi.testclient import TestClient

    from kvtool.serving import ServerConfig, create_app

    cfg = ServerConfig(extra_metrics=lambda: ["# TYPE kvtool_prefix_cache_hits_total counter",
                                              "kvtool_prefix_cache_hits_total 3"])
    with TestClient(create_app(smollm2, server_config=cfg)) as client:
        assert "kvtool_prefix_cache_hits_total 3" in client.get("/metrics").text
