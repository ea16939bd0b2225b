"""`kvtool bench ttft`: scenario layouts (token-level), the endpoint client against a scripted
OpenAI stream, and an end-to-end in-process run on SmolLM2 writing JSON + PNG."""

from __future__ import annotations

import json

import httpx
import pytest

from kvtool.bench.backends import EndpointBackend, EndpointError, tools_as_system_text
from kvtool.bench.scenarios import SCENARIOS, ChatRequest, ScenarioConfig, build
from kvtool.bench.ttft import TTFTBenchConfig, format_table, run_ttft_bench
from kvtool.cache.index import common_prefix


@pytest.mark.real_model
def test_scenarios_share_what_their_layout_allows(smollm2):
    """Ideal token-level reuse (longest prefix shared with any earlier request), from the real tokenizer."""
    share = {}
    for name in SCENARIOS:
        prompts = [smollm2.encode_chat(tools_as_system_text(r.messages, r.tools))
                   for r in build(name, ScenarioConfig())]
        share[name] = [max(common_prefix(p, q) for q in prompts[:k]) / len(p) for k, p in enumerate(prompts) if k]
    assert min(share["shared-prefix"]) > 0.9
    assert max(share["changed-prefix"]) < 0.03 and max(share["timestamp"]) < 0.03
    assert 0.03 < min(share["user-config"]) and max(share["user-config"]) < 0.15  # up to the config line
    assert 0.2 < min(share["tool-reorder"]) and max(share["tool-reorder"]) < 0.9  # up to the first moved tool
    assert 0.5 < min(share["sliding-window"]) and max(share["sliding-window"]) < 0.8  # the system prompt only
    assert min(share["status-append"]) > 0.8  # every earlier prompt is a prefix
    assert share["status-replace"][-1] < share["status-append"][-1] - 0.1  # breaks at the rewritten status
    assert len(SCENARIOS) == 8 and {s.number for s in SCENARIOS.values()} >= {"1", "2", "3", "4", "5", "6"}


def shared_by_the_first_two(model, name, cfg):
    """Tokens the first two prompts of a scenario share, as its backends render them (tools in the system turn)."""
    first, second = [model.encode_chat(tools_as_system_text(r.messages, r.tools)) for r in build(name, cfg)][:2]
    return common_prefix(first, second)


def scripted_endpoint(events, status=200, reset_ok=False, seen=None):
    def handler(request: httpx.Request):
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "stub-model"}]})
        if request.url.path in EndpointBackend.RESET_PATHS:
            return httpx.Response(200 if reset_ok else 404, json={})
        body = json.loads(request.content)
        if seen is not None:
            seen.append(body)
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        if status != 200:
            return httpx.Response(status, json={"error": {"message": "model overloaded", "type": "server_error"}})
        lines = [f"data: {json.dumps(e)}\n\n".encode() for e in events] + [b"data: [DONE]\n\n"]
        return httpx.Response(200, content=iter(lines), headers={"content-type": "text/event-stream"})

    return httpx.Client(base_url="http://stub", transport=httpx.MockTransport(handler))


def chunk(delta=None, finish=None, usage=None, **extra):
    out = {"object": "chat.completion.chunk", "choices": [] if delta is None and finish is None else
           [{"index": 0, "delta": delta or {}, "finish_reason": finish}], **extra}
    if usage is not None:
        out["usage"] = usage
    return out


def test_endpoint_client_reads_ttft_and_cached_tokens_from_the_stream():
    usage = {"prompt_tokens": 120, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 96}}
    seen = []
    events = [chunk({"role": "assistant", "content": ""}), chunk({"reasoning_content": "hm"}),
              chunk({"content": "Hi"}, "length"), chunk(usage=usage)]
    backend = EndpointBackend("http://stub/v1", max_tokens=2, client=scripted_endpoint(events, seen=seen))
    assert backend.model == "stub-model" and backend.base == "http://stub"
    req = ChatRequest([{"role": "user", "content": "q"}], [{"type": "function", "function": {"name": "f"}}], "r1")
    res = backend.send(req)
    assert (res.prompt_tokens, res.cached_tokens, res.output_tokens, res.ttft_source) == (120, 96, 2, "delta")
    assert res.ttft_ms > 0 and seen[0]["tools"] == req.tools and seen[0]["max_tokens"] == 2
    # llama.cpp reports the reused prompt as timings.cache_n; a stream with no visible delta times the finish
    llama = [chunk({"content": ""}), chunk({}, "length", usage={"prompt_tokens": 50}, timings={"cache_n": 32})]
    res = EndpointBackend("http://stub", "m", client=scripted_endpoint(llama)).send(req)
    assert (res.cached_tokens, res.ttft_source) == (32, "finish")
    with pytest.raises(EndpointError, match="503.*overloaded"):
        EndpointBackend("http://stub", "m", client=scripted_endpoint([], status=503)).send(req)


def test_endpoint_run_isolates_scenarios_without_a_reset_route():
    seen = []
    events = [chunk({"content": "x"}, "length", usage={"prompt_tokens": 10})]
    backend = EndpointBackend("http://stub", "m", client=scripted_endpoint(events, seen=seen))
    cfg = TTFTBenchConfig(scenarios=["shared-prefix", "timestamp"], warmup=False)
    record = run_ttft_bench(backend, cfg, ScenarioConfig(requests=2, policy_paragraphs=0, tools=1), log=lambda s: None)
    assert record["isolation"] == "nonce" and len(seen) == 4
    systems = [body["messages"][0]["content"] for body in seen]
    assert systems[0].startswith("[session ") and systems[0] == systems[1] and systems[2][:20] != systems[0][:20]
    row = record["scenarios"][0]
    assert row["hit_rate"] is None and row["requests"] == 2  # the stub does not report cached tokens
    assert "n/a" in format_table(record)
    backend = EndpointBackend("http://stub", "m", client=scripted_endpoint(events, reset_ok=True))
    record = run_ttft_bench(backend, cfg, ScenarioConfig(requests=1, policy_paragraphs=0, tools=1), log=lambda s: None)
    assert record["isolation"] == "reset"
    seen.clear()  # reset_cache=False: a nonce even where the reset route works (the peers' prompts stay identical)
    backend = EndpointBackend("http://stub", "m", client=scripted_endpoint(events, reset_ok=True, seen=seen),
                              reset_cache=False)
    record = run_ttft_bench(backend, cfg, ScenarioConfig(requests=1, policy_paragraphs=0, tools=1), log=lambda s: None)
    assert record["isolation"] == "nonce" and all(b["messages"][0]["content"].startswith("[session ") for b in seen)
    first = [b["messages"][0]["content"] for b in seen]
    seen.clear()
    run_ttft_bench(backend, cfg, ScenarioConfig(requests=1, policy_paragraphs=0, tools=1), log=lambda s: None,
                   run_id="0000beef")
    again = [b["messages"][0]["content"] for b in seen]
    assert again[0].startswith("[session 0000beef-1-0]\n") and again != first  # a given run id, else a random one


@pytest.mark.real_model
def test_bench_ttft_cli_end_to_end_in_process(smollm2, tmp_path, monkeypatch, capsys):
    import kvtool.models.loading
    from kvtool.cli import main

    from kvtool.testing.models import smollm2_gguf

    loaded = []
    monkeypatch.setattr(kvtool.models.loading, "load",  # reuse the session's model; record what --model named
                        lambda path, *a, **k: loaded.append(path) or smollm2)
    out = tmp_path / "ttft.json"
    rc = main(["bench", "ttft", "--model", "smollm2", "--scenarios", "shared-prefix", "timestamp",
               "--requests", "2", "--policy-paragraphs", "0", "--tools", "1", "--max-tokens", "1",
               "--out", str(out)])
    assert rc == 0 and loaded == [str(smollm2_gguf())]  # the alias names the offline model
    stdout = capsys.readouterr().out.strip().splitlines()
    record = json.loads(stdout[-1])
    assert json.loads(out.read_text()) == record
    png = tmp_path / "ttft.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert any(line.startswith("1 shared-prefix") for line in stdout)
    rows = {row["name"]: row for row in record["scenarios"]}
    first, second = rows["shared-prefix"]["results"][0]
    assert first["cached_tokens"] == 0 and second["cached_tokens"] >= 0.8 * second["prompt_tokens"]
    # the timestamp changes in its seconds: what comes before ("Current time: 2025-06-02 14:03:") is reused, exactly
    shared = shared_by_the_first_two(smollm2, "timestamp", ScenarioConfig(requests=2, policy_paragraphs=0, tools=1))
    assert [r["cached_tokens"] for r in rows["timestamp"]["results"][0]] == [0, shared]
    assert rows["timestamp"]["hit_rate_after_first"] < 0.1 < rows["shared-prefix"]["hit_rate_after_first"]
    assert record["tools_rendering"] == "system-text" and record["isolation"] == "reset"
    # where the requests parted in the cache: the timestamp's block, the shared prefix's question
    stamp, shared = rows["timestamp"]["fork"], rows["shared-prefix"]["fork"]
    assert stamp["roots"] <= 2 and stamp["fork_at_token"] <= 16 and len(set(stamp["branches"])) == 2
    assert shared["roots"] == 1 and shared["fork_at_token"] >= 0.8 * first["prompt_tokens"] // 16 * 16 - 16
    assert any("timestamp: requests part at token" in line for line in stdout)
    assert all(r["ttft_ms"] >= r["engine_ttft_ms"] > 0 for row in rows.values() for r in row["results"][0])


def test_an_endpoint_with_a_cache_tree_tells_where_requests_part():
    def segment(start, tokens, text, children=()):
        return {"start": start, "tokens": tokens, "text": text, "children": list(children)}

    tree = [segment(0, 16, "<|im_start|>system\nCurrent time: 2025-06-02 1",
                    [segment(16, 32, "4:03:07\nYou are Atlas"), segment(16, 32, "4:03:44\nYou are Atlas")])]

    def handler(request: httpx.Request):
        if request.url.path == "/v1/cache/tree":
            assert request.url.params["max_chars"] == "4000"
            return httpx.Response(200, json={"object": "prefix_cache.tree", "tree": tree})
        return httpx.Response(404, json={"error": {"message": "no route"}})

    client = httpx.Client(base_url="http://stub", transport=httpx.MockTransport(handler))
    fork = EndpointBackend("http://stub", "m", client=client).fork()
    assert fork == {"roots": 1, "fork_at_token": 16, "branches": ["…:03:07\nYou are Atlas", "…:03:44\nYou are Atlas"]}
    # an engine without the route (vLLM, llama.cpp): no fork, and the run goes on
    assert EndpointBackend("http://stub", "m", client=scripted_endpoint([])).fork() is None


@pytest.mark.real_model
def test_endpoint_run_against_a_server_whose_template_renders_no_tools(smollm2):
    """kvtool serve on SmolLM2 refuses `tools` (its template has none): the client declares them in the
    system turn from then on, and the scenarios still measure reuse, live over HTTP."""
    from kvtool.serving import ServerConfig, create_app
    from kvtool.serving.server import BackgroundServer

    with BackgroundServer(create_app(smollm2, server_config=ServerConfig())) as server:
        backend = EndpointBackend(server.base_url + "/v1", max_tokens=1)
        cfg = TTFTBenchConfig(scenarios=["shared-prefix", "timestamp"], warmup=False)
        record = run_ttft_bench(backend, cfg, ScenarioConfig(requests=2, policy_paragraphs=0, tools=1),
                                log=lambda s: None)
    assert record["tools_rendering"] == "system-text" and "does not render tools" in record["tools_refused"]
    assert record["isolation"] == "reset"
    rows = {row["name"]: row for row in record["scenarios"]}
    first, second = rows["shared-prefix"]["results"][0]
    assert first["cached_tokens"] == 0 and second["cached_tokens"] >= 0.8 * second["prompt_tokens"]
    shared = shared_by_the_first_two(smollm2, "timestamp", ScenarioConfig(requests=2, policy_paragraphs=0, tools=1))
    assert [r["cached_tokens"] for r in rows["timestamp"]["results"][0]] == [0, shared]
    assert rows["timestamp"]["fork"]["fork_at_token"] <= 16 and rows["shared-prefix"]["fork"]["roots"] == 1


def test_a_refusal_that_is_not_about_tools_is_reported_as_it_came():
    def handler(request: httpx.Request):
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        return httpx.Response(400, json={"error": {"message": "context window exceeded"}})

    backend = EndpointBackend("http://stub", client=httpx.Client(base_url="http://stub",
                                                                 transport=httpx.MockTransport(handler)))
    req = ChatRequest([{"role": "user", "content": "q"}], [{"type": "function", "function": {"name": "f"}}], "r")
    with pytest.raises(EndpointError, match="answered 400: .*context window exceeded"):
        backend.send(req)
    assert backend.describe()["tools_rendering"] == "server" and "tools_refused" not in backend.describe()
