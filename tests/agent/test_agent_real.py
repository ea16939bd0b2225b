"""The agent on a real model (Qwen2.5-Coder GGUF), in process: calls sealed at </tool_call>."""

import asyncio

import pytest

from kvtool.agent.config import AgentConfig
from kvtool.agent.demo_tools import make_demo_tools
from kvtool.agent.inprocess import InProcessBackend, template_messages
from kvtool.agent.loop import Agent
from kvtool.agent.trajectory import check_messages
from kvtool.engine import Engine

pytestmark = pytest.mark.real_model


def test_template_messages_turn_argument_strings_into_objects():
    msgs = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]}]
    out = template_messages(msgs)
    assert out[0]["content"] == "" and out[0]["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    assert msgs[0]["tool_calls"][0]["function"]["arguments"] == '{"x": 1}'  # input untouched


def test_in_process_agent_calls_a_tool_and_answers(qwen25, tmp_path):
    backend = InProcessBackend(Engine(qwen25))
    config = AgentConfig(max_iterations=3, status_bar="off", builtin_tools=False, wait_for_background=False,
                         sampling={"temperature": 0, "max_tokens": 96}, workdir=str(tmp_path))
    tools = [t for t in make_demo_tools(tmp_path, scale=0.01) if t.name == "get_weather"]
    agent = Agent(backend, tools, config)

    async def run():
        try:
            return await agent.run("What is the weather in Paris right now? Use the get_weather tool.")
        finally:
            await agent.aclose()

    result = asyncio.run(run())
    calls = [c for m in result.messages for c in m.get("tool_calls") or []]
    assert calls and calls[0]["function"]["name"] == "get_weather"
    assert "paris" in calls[0]["function"]["arguments"].lower()
    answered = {m["tool_call_id"] for m in result.messages if m["role"] == "tool"}
    assert {c["id"] for c in calls} <= answered
    check_messages(result.messages)
    assert result.turns and result.turns[0].usage.prompt_tokens > 0
