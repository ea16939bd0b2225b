"""One HTTP contract, two engines: every test runs on kvtool's own engine and on --engine vllm, with SmolLM2
and Qwen2.5 (the official `openai` client, the Responses route, the raw token stream, the render route, cached
tokens, bad input, a client that hangs up), and Gemma 3 for add_special_tokens (its tokenizer adds <bos>). The vLLM
cases skip only where vLLM is not installed."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from openai import OpenAI

pytestmark = pytest.mark.real_model

SERVERS = {("kvtool", "smol"): "smol_server", ("vllm", "smol"): "vllm_smol_server",
           ("kvtool", "qwen"): "qwen_server", ("vllm", "qwen"): "vllm_qwen_server"}
ASK = [{"role": "user", "content": "Name three colors."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module", params=list(SERVERS), ids=lambda p: f"{p[0]}-{p[1]}")
def server(request):
    engine, model = request.param
    srv = request.getfixturevalue(SERVERS[request.param])
    srv.engine, srv.model = engine, model
    return srv


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=300) as client:
        yield client


@pytest.fixture
def oai(server):
    return OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)


def model_id(client: OpenAI) -> str:
    return client.models.list().data[0].id


def test_models_names_the_engine(http, server):
    assert http.get("/v1/models").json()["data"][0]["engine"] == server.engine


DEFAULTS = {"smol": {"temperature": 0.2, "top_p": 0.9, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
                     "presence_penalty": 0.0, "frequency_penalty": 0.0, "source": "model card: SmolLM2-135M-Instruct"},
            "qwen": {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.0, "repetition_penalty": 1.05,
                     "presence_penalty": 0.0, "frequency_penalty": 0.0, "source": "model card: Qwen2.5-Coder-Instruct"}}


def test_models_shows_the_sampling_defaults_an_unset_request_takes(http, server):
    defaults = http.get("/v1/models").json()["data"][0]["sampling_defaults"]
    assert defaults == DEFAULTS[server.model]
    named = {k: v for k, v in defaults.items() if k != "source"}

    def text(**fields):
        body = {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 8, "seed": 3, **fields}
        return http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]

    assert text() == text(**named) != text(temperature=1.0, top_p=1.0, top_k=0, repetition_penalty=1.0)


def test_chat_and_stream_agree(oai):
    name = model_id(oai)
    out = oai.chat.completions.create(model=name, messages=ASK, temperature=0, max_tokens=8)
    assert out.choices[0].message.content and out.usage.completion_tokens == 8
    assert out.choices[0].finish_reason == "length"
    stream = oai.chat.completions.create(model=name, messages=ASK, temperature=0, max_tokens=8, stream=True,
                                         stream_options={"include_usage": True})
    text, usage = "", None
    for chunk in stream:
        usage = chunk.usage or usage
        text += "".join(c.delta.content or "" for c in chunk.choices)
    assert text == out.choices[0].message.content and usage.completion_tokens == 8


def test_timings_on_every_response(http):
    body = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, "temperature": 0}).json()
    t = body["timings"]
    assert t["prompt_tokens"] == body["usage"]["prompt_tokens"] and t["decode_tokens"] == 4
    assert t["ttft_ms"] > 0 and t["decode_ms"] > 0


def test_n_choices_and_seed(oai):
    out = oai.chat.completions.create(model=model_id(oai), messages=ASK, temperature=1.0, max_tokens=6, n=2, seed=7)
    assert sorted(c.index for c in out.choices) == [0, 1] and out.usage.completion_tokens == 12
    again = oai.chat.completions.create(model=model_id(oai), messages=ASK, temperature=1.0, max_tokens=6, n=2, seed=7)
    assert [c.message.content for c in again.choices] == [c.message.content for c in out.choices]


def test_stop_string_ends_and_is_cut(http):
    base = http.post("/v1/completions", json={"prompt": "1, 2, 3, 4,", "max_tokens": 12, "temperature": 0}).json()
    text = base["choices"][0]["text"]
    cut = text.strip().split(",")[1].strip()  # the second number the model writes
    assert cut, text
    out = http.post("/v1/completions", json={"prompt": "1, 2, 3, 4,", "max_tokens": 12, "temperature": 0,
                                             "stop": [cut]}).json()
    choice = out["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == cut
    assert cut not in choice["text"] and text.startswith(choice["text"])


def test_logprobs(oai):
    out = oai.chat.completions.create(model=model_id(oai), messages=ASK, temperature=0, max_tokens=4, logprobs=True,
                                      top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert abs(entry.logprob - entry.top_logprobs[0].logprob) < 1e-3, "greedy takes the top token"


def test_tool_call_streams_its_arguments(oai, server):
    if server.model == "smol":
        pytest.skip("SmolLM2's chat template has no tools")
    stream = oai.chat.completions.create(model=model_id(oai), messages=[
        {"role": "user", "content": "What is the weather in Paris right now?"}], tools=[WEATHER], temperature=0,
        max_tokens=40, stream=True)
    calls, finish = {}, None
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for tc in choice.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"name": None, "arguments": ""})
                entry["name"] = tc.function.name or entry["name"]
                entry["arguments"] += tc.function.arguments or ""
    assert finish == "tool_calls"
    assert calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"]) == {"city": "Paris"}


def test_forced_tool_call_follows_the_schema(oai, server):
    if server.model == "smol":
        pytest.skip("SmolLM2's chat template has no tools")
    out = oai.chat.completions.create(model=model_id(oai), messages=[{"role": "user", "content": "Tell me about Oslo."}],
                                      tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=30)
    call = out.choices[0].message.tool_calls[0]
    assert out.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments)["city"], str)



def test_a_forced_call_ends_with_its_closing_tag(http, server, sse_events):
    """The forced call's JSON is followed by the format's closing tag before the turn ends, as the model writes it
    unforced: on Qwen2.5 the one token </tool_call> (on vLLM through the same llguidance grammar)."""
    if server.model == "smol":
        pytest.skip("SmolLM2's chat template has no tools")
    with http.stream("POST", "/v1/chat/completions/raw", json={
            "messages": [{"role": "user", "content": "Tell me about Oslo."}], "tools": [WEATHER],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "temperature": 0,
            "max_tokens": 40}) as r:
        events = sse_events(r)
    tokens = [e for e in events[:-2] if "piece" in e]
    text = "".join(t["piece"] for t in tokens)
    body = text[: text.rindex("</tool_call>")].replace("<tool_call>", "").strip()
    assert json.loads(body)["name"] == "get_weather", text
    assert any(t["piece"] == "</tool_call>" for t in tokens[-3:]), tokens[-4:]

def test_json_schema_output(http):
    schema = {"type": "object", "properties": {"color": {"type": "string", "enum": ["red", "green"]}},
              "required": ["color"], "additionalProperties": False}
    body = http.post("/v1/chat/completions", json={
        "messages": ASK, "temperature": 0, "max_tokens": 30,
        "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}}).json()
    assert json.loads(body["choices"][0]["message"]["content"])["color"] in ("red", "green")


TAGS = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 10},
                                                 "minItems": 2, "maxItems": 2, "uniqueItems": True}},
        "required": ["tags"], "additionalProperties": False}


def test_json_schema_strict_or_enforced_but_for_what_is_named(http, server, sse_events, caplog):
    """strict refuses a keyword the grammar cannot enforce; without it the rest holds (two short tags) and the
    keyword is named in the header, timings.structured_output (streamed too) and the server's log."""
    fmt = {"type": "json_schema", "json_schema": {"name": "tags", "schema": TAGS}}
    ask = {"messages": [{"role": "user", "content": "Two tags for a cat photo, as JSON."}], "temperature": 0,
           "max_tokens": 30}
    with caplog.at_level("WARNING", logger="kvtool.serving"):
        r = http.post("/v1/chat/completions", json={**ask, "response_format": fmt})
    assert r.status_code == 200 and r.headers["x-kvtool-unenforced"] == "uniqueItems", r.text
    log = server.log if server.engine == "vllm" else caplog.text  # vLLM's server is a child process
    assert "enforces the JSON schema without uniqueItems (schema.properties.tags)" in log
    body = r.json()
    assert body["timings"]["structured_output"] == {"strict": False, "unenforced": ["uniqueItems"]}
    if body["choices"][0]["finish_reason"] == "stop":
        tags = json.loads(body["choices"][0]["message"]["content"])["tags"]
        assert len(tags) == 2 and all(len(t) <= 10 for t in tags), tags
    with http.stream("POST", "/v1/chat/completions", json={**ask, "response_format": fmt, "stream": True}) as r:
        assert r.headers["x-kvtool-unenforced"] == "uniqueItems"
        last = [e for e in sse_events(r) if isinstance(e, dict) and e.get("timings")][-1]
    assert last["timings"]["structured_output"]["unenforced"] == ["uniqueItems"]
    strict = {**fmt, "json_schema": {**fmt["json_schema"], "strict": True}}
    r = http.post("/v1/chat/completions", json={**ask, "response_format": strict})
    assert r.status_code == 400 and "schema.properties.tags uses uniqueItems" in r.text, r.text


def test_raw_token_stream(http, sse_events):
    with http.stream("POST", "/v1/chat/completions/raw", json={"messages": ASK, "max_tokens": 5,
                                                                "temperature": 0}) as r:
        events = sse_events(r)
    tokens, summary = events[:-2], events[-2]
    assert events[-1] == "[DONE]" and summary["done"] and summary["usage"]["completion_tokens"] == 5
    assert len(tokens) == 5
    times = [t["t_ms"] for t in tokens]
    assert times == sorted(times) and all(t["channel"] in ("content", "reasoning") for t in tokens)
    detok = http.post("/detokenize", json={"tokens": [t["id"] for t in tokens], "with_pieces": True}).json()
    assert detok["pieces"] == [t["piece"] for t in tokens]


def test_render_route(http):
    out = http.post("/v1/chat/template", json={"messages": ASK}).json()
    assert out["count"] == len(out["token_ids"]) == len(out["tokens"]) and "Name three colors." in out["prompt"]
    chat = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == out["count"]


def test_cached_tokens_on_a_repeated_prefix(http):
    system = "You are a careful assistant. " + " ".join(f"Rule {i}: answer briefly and politely." for i in range(40))
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}]
    first = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json()["usage"]
    again = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json()["usage"]
    assert first["prompt_tokens"] > 256
    # vLLM caches whole blocks (128 tokens on CPU); kvtool all but the last token
    assert again["prompt_tokens_details"]["cached_tokens"] >= first["prompt_tokens"] - 128
    assert http.post("/v1/cache/reset").status_code == 200  # both engines empty their prefix cache on request
    after = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json()["usage"]
    assert after["prompt_tokens_details"]["cached_tokens"] == 0


def test_responses_route(oai):
    """POST /v1/responses is the chat route's answer in the Responses shape, streamed too, and a follow-up by
    previous_response_id is served from the prefix cache."""
    name, rules = model_id(oai), "You are a careful assistant. " + " ".join(f"Rule {i}: be brief." for i in range(40))
    out = oai.responses.create(model=name, input=ASK[0]["content"], instructions=rules, max_output_tokens=6,
                               temperature=0)
    chat = oai.chat.completions.create(model=name, messages=[{"role": "system", "content": rules}, *ASK],
                                       max_tokens=6, temperature=0)
    assert out.output_text == chat.choices[0].message.content and out.usage.input_tokens == chat.usage.prompt_tokens
    assert out.model_extra["timings"]["decode_tokens"] == out.usage.output_tokens == chat.usage.completion_tokens
    with oai.responses.stream(model=name, input="One more.", instructions=rules, previous_response_id=out.id,
                              max_output_tokens=6, temperature=0) as stream:
        events = list(stream)
    last = events[-1].response
    assert events[0].type == "response.created" and last.status in ("completed", "incomplete")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == last.output_text
    assert last.usage.input_tokens > out.usage.input_tokens + out.usage.output_tokens > 256
    assert last.usage.input_tokens_details.cached_tokens >= out.usage.input_tokens - 128  # vLLM: 128-token blocks


BAD = [("/v1/chat/completions", {"messages": "hi"}),
       ("/v1/chat/completions", {"messages": ASK, "max_tokens": -1}),
       ("/v1/chat/completions", {"messages": ASK, "temperature": "hot"}),
       ("/v1/chat/completions", {"messages": ASK, "max_tokens": 10 ** 7}),
       ("/v1/chat/completions", {"messages": ASK, "logit_bias": {"999999999": 5}}),
       ("/v1/chat/completions", {"messages": ASK, "response_format": {"type": "json_schema",
                                                                     "json_schema": {"name": "x", "schema": 5}}}),
       ("/v1/completions", {"prompt": [[1, 2, 10 ** 9]]}),
       ("/v1/completions", {"prompt": ""}),
       ("/v1/chat/completions", {"messages": ASK, "model": "no-such-model"}),
       ("/v1/chat/completions", {"messages": ASK, "n": 0}),
       ("/v1/responses", {"input": [{"type": "web_search_call"}]}),
       ("/v1/responses", {"input": "hi", "previous_response_id": "resp_unknown"})]


@pytest.mark.parametrize("path,body", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_input_is_a_4xx(http, path, body):
    r = http.post(path, json=body)
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    assert r.json()["error"]["message"]


def test_client_disconnect_mid_stream_frees_the_request(http, server):
    with http.stream("POST", "/v1/chat/completions", json={"messages": ASK, "stream": True, "max_tokens": 400,
                                                            "ignore_eos": True}) as r:
        for line in r.iter_lines():
            if '"content"' in line and '"role"' not in line:
                break  # one token arrived: hang up
    deadline = time.monotonic() + 60
    while http.get("/health").json()["running"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert http.get("/health").json()["running"] == 0
    out = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 2}).json()
    assert out["usage"]["completion_tokens"] == 2, "the server serves on"


def test_kvtool_only_routes_name_the_engine(http, server):
    if server.engine == "kvtool":
        assert http.get("/v1/cache/tree").status_code == 200
        return
    for method, path in [("GET", "/v1/cache/tree"), ("POST", "/v1/cache/pin"), ("POST", "/v1/cache/edit"),
                         ("POST", "/v1/viz/attention"), ("POST", "/v1/cache/save")]:
        r = http.request(method, path, json={})
        assert r.status_code == 501 and "vllm" in r.json()["error"]["message"], (path, r.text)
    assert "--cache-file" in http.post("/v1/cache/save").json()["error"]["message"]
    assert http.get("/v1/skills").json() == {"object": "list", "data": [], "enabled": False}  # no --skills given
    r = http.post("/v1/chat/completions", json={"messages": ASK, "skills": ["x"], "max_tokens": 1})
    assert r.status_code == 400 and "--engine vllm" in r.json()["error"]["message"]


def test_metrics(http, server):
    text = http.get("/metrics").text
    assert "kvtool_generation_tokens_total" in text and "kvtool_time_to_first_token_seconds_bucket" in text
    if server.engine == "vllm":
        assert "vllm:prompt_tokens" in text


GEMMA = {"kvtool": "gemma_server", "vllm": "vllm_gemma_server"}
FRANCE = "The capital of France is"


@pytest.fixture(scope="module")
def gemma_reference():
    """transformers on Gemma 3's converted folder: the tokenizer's ids of FRANCE (<bos> first) and of a chat, and
    the greedy 8-token continuations of FRANCE with and without <bos>."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvtool.models.loading import load_text
    from kvtool.testing.models import gemma3_gguf

    folder = str(load_text(str(gemma3_gguf())).folder)
    tok = AutoTokenizer.from_pretrained(folder)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = tok.encode(FRANCE)
    with torch.no_grad():
        def greedy(prompt):
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
            return tok.decode(out[0, len(prompt):], skip_special_tokens=True)

        texts = greedy(ids), greedy(ids[1:])
    chat = tok.apply_chat_template(ASK, tokenize=True, add_generation_prompt=True, return_dict=False)
    return {"ids": ids, "text": texts[0], "bare_text": texts[1], "chat": list(chat),
            "chat_doubled": tok.encode(tok.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True))}


@pytest.mark.parametrize("engine", list(GEMMA), ids=lambda e: f"{e}-gemma")
def test_add_special_tokens_as_the_tokenizer_adds_them(engine, request, gemma_reference):
    """Gemma 3 (its tokenizer adds <bos>): a raw prompt gets it unless add_special_tokens is false, and then
    continues as transformers does; a chat prompt has the template's one <bos> unless add_special_tokens is true."""
    ref, srv = gemma_reference, request.getfixturevalue(GEMMA[engine])
    with httpx.Client(base_url=srv.base_url, timeout=300) as http:
        def complete(**extra):
            body = {"prompt": FRANCE, "temperature": 0, "max_tokens": 8, "ignore_eos": True, **extra}
            out = http.post("/v1/completions", json=body).json()
            return out["choices"][0]["text"], out["usage"]["prompt_tokens"]

        def chat_prompt_tokens(**extra):
            body = {"messages": ASK, "max_tokens": 1, **extra}
            return http.post("/v1/chat/completions", json=body).json()["usage"]["prompt_tokens"]

        assert complete() == (ref["text"], len(ref["ids"]))
        assert complete(add_special_tokens=False) == (ref["bare_text"], len(ref["ids"]) - 1)
        assert ref["bare_text"] != ref["text"]
        assert http.post("/tokenize", json={"prompt": FRANCE}).json()["tokens"] == ref["ids"]
        assert http.post("/tokenize", json={"messages": ASK}).json()["tokens"] == ref["chat"]
        assert chat_prompt_tokens() == len(ref["chat"])
        assert chat_prompt_tokens(add_special_tokens=True) == len(ref["chat_doubled"]) == len(ref["chat"]) + 1
