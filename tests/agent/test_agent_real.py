"""The agent on a real model (Qwen2.5-Coder GGUF), in process: calls sealed at </tool_call>."""

import pytest

from kvtool.agent.inprocess import InProcessBackend, template_messages
from kvtool.engine import Engine
from kvtool.testing.agent import run_weather_task

pytestmark = pytest.mark.real_model


def test_template_messages_turn_argument_strings_into_objects():
    msgs = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]}]
    out = template_messages(msgs)
    assert out[0]["content"] == "" and out[0]["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    assert msgs[0]["tool_calls"][0]["function"]["arguments"] == '{"x": 1}'  # input untouched


def test_in_process_agent_calls_a_tool_and_answers(qwen25, tmp_path):
    result, calls = run_weather_task(InProcessBackend(Engine(qwen25)), tmp_path)
    assert result.turns and result.turns[0].usage.prompt_tokens > 0


def test_in_process_sampling_keys_and_values_are_checked_when_the_agent_is_built(qwen25):
    from kvtool.agent import Agent, AgentConfig
    from kvtool.errors import InvalidParameterError

    backend = InProcessBackend(Engine(qwen25))
    with pytest.raises(InvalidParameterError, match=r"does not take \['temprature'\]; it takes frequency_penalty"):
        Agent(backend, [], AgentConfig(sampling={"temprature": 0}))  # the typo was dropped: it sampled at 1.0
    with pytest.raises(InvalidParameterError, match="invalid sampling parameter top_p=2"):
        Agent(backend, [], AgentConfig(sampling={"top_p": 2}))
    assert Agent(backend, [], AgentConfig(sampling={"temperature": 0, "max_tokens": 8})).config.sampling
