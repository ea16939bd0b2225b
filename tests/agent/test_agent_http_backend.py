"""OpenAIHTTPBackend against a real HTTP server replaying OpenAI chunk streams."""

import asyncio
import socket

import openai
import pytest

from kvtool.agent.backend import BackendError, BackendUnavailable
from kvtool.agent.http_backend import OpenAIHTTPBackend, iter_sse_data
from kvtool.agent.demos.script import http_error, reply


async def collect(backend, messages=None, tools=()):
    return [d async for d in backend.stream(messages or [{"role": "user", "content": "hi"}], list(tools))]


def test_deltas_carry_reasoning_content_tool_fragments_finish_and_usage(endpoint):
    ep = endpoint([reply("Hello there.", reasoning="Let me think.",
                         tool_calls=[("get_weather", {"city": "Paris"})], ids=["call_a"])])
    deltas = asyncio.run(collect(OpenAIHTTPBackend(ep.base_url, "fake-model")))
    assert "".join(d.reasoning for d in deltas) == "Let me think."
    assert "".join(d.content for d in deltas) == "Hello there."
    frags = [f for d in deltas for f in d.tool_calls]
    assert frags[0].id == "call_a" and frags[0].name == "get_weather"
    assert "".join(f.arguments for f in frags) == '{"city": "Paris"}'
    assert [d.finish_reason for d in deltas if d.finish_reason] == ["tool_calls"]
    usage = [d.usage for d in deltas if d.usage][-1]
    assert usage.prompt_tokens > 0 and usage.cached_tokens == 0
    body = ep.requests[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}


def test_second_request_reports_cached_prefix(endpoint):
    ep = endpoint([reply("a"), reply("b")])
    backend = OpenAIHTTPBackend(ep.base_url, "fake-model")
    history = [{"role": "system", "content": "You are helpful. " * 20}, {"role": "user", "content": "one"}]
    asyncio.run(collect(backend, history))
    second = asyncio.run(collect(backend, history + [{"role": "assistant", "content": "a"},
                                                      {"role": "user", "content": "two"}]))
    usage = [d.usage for d in second if d.usage][-1]
    assert 0 < usage.cached_tokens < usage.prompt_tokens


def test_http_errors_become_backend_errors_with_retryability(endpoint):
    ep = endpoint([http_error(503, "overloaded"), http_error(400, "bad request")])
    backend = OpenAIHTTPBackend(ep.base_url, "m")
    with pytest.raises(BackendError, match="503.*overloaded") as e503:
        asyncio.run(collect(backend))
    assert e503.value.retryable
    with pytest.raises(BackendError, match="400") as e400:
        asyncio.run(collect(backend))
    assert not e400.value.retryable


def test_unreachable_endpoint_says_what_to_do():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again below: nothing listens there
    backend = OpenAIHTTPBackend(f"http://127.0.0.1:{port}/v1", "m")
    with pytest.raises(BackendUnavailable, match="--endpoint"):
        asyncio.run(backend.list_models())
    with pytest.raises(BackendUnavailable, match="kvtool serve"):
        asyncio.run(collect(backend))


def test_cancelling_the_consumer_closes_the_http_stream(endpoint):
    ep = endpoint([reply("word " * 200, delay_s=0.01)])

    async def main():
        backend = OpenAIHTTPBackend(ep.base_url, "m")
        seen = 0

        async def consume():
            nonlocal seen
            async for _ in backend.stream([{"role": "user", "content": "x"}], []):
                seen += 1

        task = asyncio.create_task(consume())
        while seen < 3:
            await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        for _ in range(100):  # let the server notice
            if ep.disconnects:
                break
            await asyncio.sleep(0.01)
        return seen

    seen = asyncio.run(main())
    assert 0 < seen < 100
    assert ep.disconnects == 1


def test_sse_parser_joins_multiline_data_and_skips_comments():
    async def lines():
        for line in [": keepalive", "data: a", "data: b", "", "event: x", "data: c", ""]:
            yield line

    async def main():
        return [d async for d in iter_sse_data(lines())]

    assert asyncio.run(main()) == ["a\nb", "c"]


def test_official_openai_client_parses_the_fake_stream(endpoint):
    """The fake endpoint speaks real OpenAI chunks: the official client accepts them."""
    ep = endpoint([reply("Hi!", tool_calls=[("calculator", {"expression": "1+1"})])])
    client = openai.OpenAI(base_url=ep.base_url, api_key="x")
    stream = client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hi"}],
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    args = "".join(tc.function.arguments or "" for c in chunks if c.choices
                   for tc in c.choices[0].delta.tool_calls or [])
    assert text == "Hi!" and args == '{"expression": "1+1"}'
    assert chunks[-1].usage.prompt_tokens > 0


def split_all(pieces):
    from kvtool.agent.http_backend import ThinkSplitter

    sp, reasoning, content = ThinkSplitter(), "", ""
    for p in [*pieces, None]:
        r, c = sp.flush() if p is None else sp.feed(p)
        reasoning, content = reasoning + r, content + c
    return reasoning, content


def test_think_block_in_content_becomes_reasoning_even_when_tags_are_split():
    assert split_all(["<think>\nplan it", "</think>\n\nAnswer."]) == ("\nplan it", "Answer.")
    assert split_all(["<th", "ink>a", "b</th", "ink>", "c"]) == ("ab", "c")
    assert split_all(["Use <think> tags", " like this"]) == ("", "Use <think> tags like this")
    assert split_all(["<", "b>bold</b>"]) == ("", "<b>bold</b>")
    assert split_all(["<think>never closed"]) == ("never closed", "")


def test_think_split_over_http(endpoint):
    ep = endpoint([reply("<think> weigh options </think> Go left.")])
    deltas = asyncio.run(collect(OpenAIHTTPBackend(ep.base_url, "m")))
    assert "".join(d.reasoning for d in deltas).split() == ["weigh", "options"]
    assert "".join(d.content for d in deltas).strip() == "Go left."


@pytest.mark.parametrize("sampling, message", [
    ({"messages": []}, r"\['messages'\] are set by the HTTP backend itself"),
    ({"stream": False, "tools": []}, r"\['stream', 'tools'\] are set by the HTTP backend itself"),
    ({"n": 3}, "n=3: the agent reads one choice per call"),
    ({"temperature": -0.5}, r"invalid sampling parameter temperature=-0.5: must be in \[0, 100\]"),
    ({"top_p": "high"}, "invalid sampling parameter top_p='high': must be a number"),
    ({"stop": ["ok", 3]}, "invalid sampling parameter stop=\\['ok', 3\\]: must be a list of non-empty strings"),
    ({"seed": float("inf")}, "values must be JSON numbers"),
])
def test_agent_refuses_sampling_the_http_backend_cannot_send(sampling, message):
    from kvtool.agent import Agent, AgentConfig
    from kvtool.errors import InvalidParameterError

    with pytest.raises(InvalidParameterError, match=f"AgentConfig.sampling for http://127.0.0.1:9/v1: {message}"):
        Agent(OpenAIHTTPBackend("http://127.0.0.1:9/v1", "m"), [], AgentConfig(sampling=sampling))


def test_sampling_other_servers_take_passes_through_to_the_request(endpoint):
    from kvtool.agent import Agent, AgentConfig

    ep = endpoint([reply("fine")])
    sampling = {"temperature": 0.0, "stop": "END", "top_k": 20, "mirostat": 2, "n": 1}
    agent = Agent(OpenAIHTTPBackend(ep.base_url, "m"), [], AgentConfig(sampling=sampling, builtin_tools=False))
    asyncio.run(agent.run("hi"))
    assert {k: ep.requests[0][k] for k in sampling} == sampling
