"""The agent end to end through `kvtool serve` on the real Qwen2.5-Coder GGUF: streamed tool calls over HTTP,
a real tool run, the result sent back, a final answer, and the server's prefix cache reported per turn."""

import asyncio

import pytest

from kvtool.agent import Agent, AgentConfig, OpenAIHTTPBackend, check_messages, make_demo_tools

pytestmark = pytest.mark.real_model


def test_agent_through_kvtool_serve_calls_the_tool_and_answers(qwen_server, tmp_path):
    config = AgentConfig(max_iterations=3, answer_on_last_iteration=True, status_bar="append", builtin_tools=False,
                         wait_for_background=False,
                         sampling={"temperature": 0, "max_tokens": 96}, workdir=str(tmp_path))
    tools = [t for t in make_demo_tools(tmp_path, scale=0.01) if t.name == "get_weather"]
    agent = Agent(OpenAIHTTPBackend(qwen_server.base_url + "/v1"), tools, config)

    async def run():
        try:
            return await agent.run("What is the weather in Paris right now? Use the get_weather tool.")
        finally:
            await agent.aclose()

    result = asyncio.run(run())
    calls = [c for m in result.messages for c in m.get("tool_calls") or []]
    assert calls and calls[0]["function"]["name"] == "get_weather"
    assert "paris" in calls[0]["function"]["arguments"].lower()
    results = [m for m in result.messages if m["role"] == "tool"]
    assert {m["tool_call_id"] for m in results} >= {c["id"] for c in calls}
    assert any("Paris" in m["content"] and "error" not in m["content"].lower() for m in results)
    check_messages(result.messages)
    final = result.messages[-1]
    assert final["role"] == "assistant" and not final.get("tool_calls") and final["content"].strip()
    assert len(result.turns) >= 2 and result.turns[1].usage.cached_tokens > 0  # turn 2 reuses turn 1's prefix
