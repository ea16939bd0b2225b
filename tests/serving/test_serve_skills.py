"""`kvtool serve --skills`: blocks spliced into prompts that contain a skill, the `skills` request
field, GET /v1/skills, and usage/timings counting the tokens served from blocks (real SmolLM2)."""

import json

import httpx
import pytest

from kvtool.config import EngineConfig

pytestmark = pytest.mark.real_model

HAIKU = ("---\nname: haiku\ndescription: Write haiku poems.\n---\n# Haiku\nWrite exactly three lines of 5, 7 and 5 "
         "syllables. Use one seasonal word. No title, no rhyme, no punctuation at the end of a line.\n")
LIMERICK = ("---\nname: limerick\ndescription: Write limericks.\n---\n# Limerick\nFive lines, rhyme scheme AABBA. "
            "Lines 1, 2 and 5 have three stressed beats; lines 3 and 4 have two. End with a twist.\n")
QUESTION = [{"role": "user", "content": "Write a short poem about autumn."}]


@pytest.fixture(scope="module")
def catalog(smollm2, skill_catalog):
    return skill_catalog(smollm2, {"haiku.md": HAIKU, "limerick.md": LIMERICK})


@pytest.fixture(scope="module")
def skilled(smollm2, catalog):
    from kvtool.serving import ServerConfig, create_app
    from kvtool.serving.server import BackgroundServer

    app = create_app(smollm2, EngineConfig(skill_repair="none", skill_min_tokens=0), ServerConfig(default_max_tokens=4),
                     skills=catalog)
    srv = BackgroundServer(app).start()
    with httpx.Client(base_url=srv.base_url, timeout=120) as client:
        yield client
    srv.stop()


def chat(client, **body):
    r = client.post("/v1/chat/completions", json={"temperature": 0, "max_tokens": 4, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_lists_the_catalog(skilled, catalog):
    body = skilled.get("/v1/skills").json()
    assert body["enabled"] and body["repair"] == "none"
    rows = {row["name"]: row for row in body["data"]}
    assert set(rows) == {"haiku", "limerick"}
    assert rows["haiku"]["tokens"] == len(catalog.block("haiku")) and rows["haiku"]["description"] == "Write haiku poems."


def test_skills_field_splices_the_blocks_and_reports_them(skilled, catalog):
    skilled.post("/v1/cache/reset")
    n_blocks = len(catalog.block("haiku")) + len(catalog.block("limerick"))
    template = skilled.post("/v1/chat/template", json={"messages": QUESTION, "skills": ["haiku", "limerick"]}).json()
    ids = template["token_ids"]
    block = catalog.block("haiku").token_ids
    assert any(ids[i:i + len(block)] == block for i in range(len(ids))), "the rendered prompt holds the block verbatim"

    out = chat(skilled, messages=QUESTION, skills=["haiku", "limerick"])
    usage, timings = out["usage"], out["timings"]
    assert usage["prompt_tokens"] == template["count"]
    assert usage["prompt_tokens_details"]["skill_block_tokens"] == n_blocks == timings["skill_block_tokens"]
    assert timings["prefill_tokens"] == usage["prompt_tokens"] - n_blocks - usage["prompt_tokens_details"]["cached_tokens"]
    assert usage["completion_tokens"] >= 1 and out["choices"][0]["finish_reason"] in ("stop", "length")

    # The next turn of that conversation: the composed KV is now an ordinary prefix-cache hit.
    again = chat(skilled, messages=QUESTION, skills=["haiku", "limerick"])
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= template["count"] - 16
    assert again["choices"][0]["message"]["content"] == out["choices"][0]["message"]["content"]


def test_a_skill_turn_sent_by_the_client_is_spliced_too(skilled, catalog):
    """No extension field: the client's own Skill call + tool result render to the block's exact text."""
    skilled.post("/v1/cache/reset")
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "Skill", "arguments": json.dumps({"name": "haiku"})}}]}
    result = {"role": "tool", "tool_call_id": "call_1", "content": catalog.skills["haiku"].content}
    out = chat(skilled, messages=[*QUESTION, call, result])
    assert out["usage"]["prompt_tokens_details"]["skill_block_tokens"] == len(catalog.block("haiku"))


def test_streamed_usage_reports_block_tokens(skilled, catalog, sse_events):
    skilled.post("/v1/cache/reset")
    body = {"messages": QUESTION, "skills": ["limerick"], "temperature": 0, "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True}}
    with skilled.stream("POST", "/v1/chat/completions", json=body) as r:
        events = sse_events(r)
    usage = [e for e in events if isinstance(e, dict) and e.get("usage")][-1]["usage"]
    assert usage["prompt_tokens_details"]["skill_block_tokens"] == len(catalog.block("limerick"))


def test_n_choices_of_a_spliced_prompt_beside_another_request(skilled, catalog):
    """n=2 siblings hold no prefix-cache handle of their own; they used to break the batch they ran in."""
    import threading

    skilled.post("/v1/cache/reset")
    alone = chat(skilled, messages=QUESTION, skills=["haiku"], max_tokens=4)["choices"][0]["message"]["content"]
    other = {}
    thread = threading.Thread(target=lambda: other.update(out=chat(skilled, messages=QUESTION, max_tokens=8)))
    thread.start()
    out = chat(skilled, messages=QUESTION, skills=["haiku"], max_tokens=4, n=2)
    thread.join()
    assert [c["message"]["content"] for c in out["choices"]] == [alone, alone]
    assert other["out"]["choices"][0]["finish_reason"] in ("stop", "length")
    r = skilled.post("/v1/completions", json={"prompt": ["Autumn", "Rain"], "n": 2, "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and len(r.json()["choices"]) == 4
    assert skilled.get("/health").json()["status"] == "ok"


@pytest.mark.parametrize("skills, needle", [(["sonnet"], "'sonnet' is not a skill of this server"),
                                            (["haiku", "haiku"], "lists a skill twice")])
def test_bad_skill_requests_are_400(skilled, skills, needle):
    r = skilled.post("/v1/chat/completions", json={"messages": QUESTION, "skills": skills, "max_tokens": 2})
    assert r.status_code == 400 and needle in r.json()["error"]["message"]
    assert skilled.get("/health").json()["status"] == "ok"


def test_server_without_skills_refuses_the_field(smol):
    r = smol.post("/v1/chat/completions", json={"messages": QUESTION, "skills": ["haiku"], "max_tokens": 2})
    assert r.status_code == 400 and "--skills DIR" in r.json()["error"]["message"]
    assert smol.get("/v1/skills").json() == {"object": "list", "data": [], "enabled": False}


def test_agent_skill_tool_result_is_spliced_by_the_server(skilled, catalog):
    """The agent's Skill tool loads a skill on demand; sent to kvtool serve, that turn comes from the block."""
    import asyncio
    from pathlib import Path

    from kvtool.agent import Agent, AgentConfig, FakeEndpoint, OpenAIHTTPBackend, reply, skill_tool

    tool, listing = skill_tool(Path(catalog.skills["haiku"].path).parent)
    assert "- haiku: Write haiku poems." in listing and "- limerick: Write limericks." in listing
    ep = FakeEndpoint([reply(tool_calls=[("Skill", {"name": "haiku"})], ids=["call_s"]), reply("Done.")])
    ep.start()
    try:
        config = AgentConfig(system_prompt=f"You write poems.\n\n{listing}", max_iterations=3,
                             wait_for_background=False)
        result = asyncio.run(Agent(OpenAIHTTPBackend(ep.base_url, "fake-model"), [tool], config).run("A haiku."))
    finally:
        ep.stop()
    assert result.stop_reason != "max_iterations" and len(ep.requests) == 2
    sent = ep.requests[1]["messages"]  # what the model saw after the Skill call
    assert any(m["role"] == "tool" and m["content"] == catalog.skills["haiku"].content for m in sent)
    out = chat(skilled, messages=sent, max_tokens=2)
    assert out["usage"]["prompt_tokens_details"]["skill_block_tokens"] == len(catalog.block("haiku"))


def test_query_guided_repair_through_the_server(smollm2, catalog):
    from kvtool.serving import ServerConfig, create_app
    from kvtool.serving.server import BackgroundServer

    spec = "recompute_attended:ratio=0.25,window=64"
    app = create_app(smollm2, EngineConfig(skill_repair=spec, skill_min_tokens=0), ServerConfig(default_max_tokens=4),
                     skills=catalog)
    with BackgroundServer(app) as srv, httpx.Client(base_url=srv.base_url, timeout=120) as client:
        assert client.get("/v1/skills").json()["repair"] == spec + ",score=attention_v"  # every knob named
        out = chat(client, messages=QUESTION, skills=["haiku"])
    n_block = len(catalog.block("haiku"))
    usage, timings = out["usage"], out["timings"]
    assert usage["prompt_tokens_details"]["skill_block_tokens"] == n_block - int(0.25 * n_block)
    assert timings["prefill_tokens"] == usage["prompt_tokens"] - timings["skill_block_tokens"]
    assert usage["completion_tokens"] >= 1
