"""The OpenAI Agents SDK against `kvtool serve` on the real Qwen2.5-Coder GGUF: its default model class
(OpenAIResponsesModel, so POST /v1/responses) runs a tool-using agent to a final answer, with Runner.run_sync
and with Runner.run_streamed (the SDK reading the Responses event stream)."""

from __future__ import annotations

import asyncio

import pytest

pytestmark = pytest.mark.real_model
agents = pytest.importorskip("agents", reason="the Agents SDK is in the agents extra (pip install -e '.[agents]')")
PROMPT = "What is the weather in Paris right now?"
# the model's generation_config.json sets repetition_penalty 1.05, under which greedy Qwen2.5-Coder-0.5B writes its
# call again as text after the tool's result instead of answering: the SDK's requests turn it off
NO_PENALTY = {"repetition_penalty": 1.0}


def weather_agent(server, calls: list):
    from openai import AsyncOpenAI

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Get the current weather for a city."""
        calls.append(city)
        return f"The weather in {city} is sunny, 24 C."

    class AnswerAfterTheTool(agents.AgentHooks):
        """Qwen2.5-Coder-0.5B calls get_weather again and again under tool_choice auto; once the tool ran, the
        next turn is asked for text (tool_choice none), as kvtool's own agent does on its last iteration."""

        async def on_tool_end(self, context, agent, tool, result):
            agent.model_settings = agent.model_settings.resolve(agents.ModelSettings(tool_choice="none"))

    agents.set_tracing_disabled(True)
    agents.set_default_openai_client(AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused",
                                                 max_retries=0, timeout=300), use_for_tracing=False)
    return agents.Agent(name="weather", instructions="Answer with the tools you have.", tools=[get_weather],
                        model=server.app.state.served.name, hooks=AnswerAfterTheTool(), reset_tool_choice=False,
                        model_settings=agents.ModelSettings(temperature=0, max_tokens=60, extra_body=NO_PENALTY))


def check_answered(result, calls: list) -> None:
    assert calls and {c.lower() for c in calls} == {"paris"}
    kinds = [item.type for item in result.new_items]
    assert kinds[0] == "tool_call_item" and "tool_call_output_item" in kinds and kinds[-1] == "message_output_item"
    assert "24" in result.final_output and len(result.raw_responses) == 2


def test_agents_sdk_calls_the_tool_and_answers(qwen_server):
    calls: list = []
    result = agents.Runner.run_sync(weather_agent(qwen_server, calls), PROMPT, max_turns=3)
    check_answered(result, calls)


def test_agents_sdk_streamed_run(qwen_server):
    calls: list = []

    async def run():
        result = agents.Runner.run_streamed(weather_agent(qwen_server, calls), PROMPT, max_turns=3)
        raw = [ev.data.type async for ev in result.stream_events() if ev.type == "raw_response_event"]
        return result, raw

    result, raw = asyncio.run(run())
    check_answered(result, calls)
    assert raw.count("response.completed") == 2 and "response.function_call_arguments.done" in raw
    assert "response.output_text.delta" in raw
