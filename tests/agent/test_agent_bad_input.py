"""Bad input from the model or a broken tool becomes a clear tool result; the loop goes on."""

import asyncio

from kvtool.agent.config import AgentConfig
from kvtool.agent.loop import Agent
from kvtool.agent.retry import RetryPolicy
from kvtool.agent.script import reply
from kvtool.agent.scripted import ScriptedBackend
from kvtool.agent.tools import Tool
from kvtool.agent.trajectory import check_messages

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def weather_tool(calls: list):
    def get_weather(city: str) -> str:
        calls.append(city)
        return f"{city}: sunny"

    return Tool("get_weather", "weather", CITY, get_weather)


def run_one_turn(tool_calls, tools, **cfg):
    backend = ScriptedBackend([reply(tool_calls=tool_calls), reply("recovered")])
    config = AgentConfig(status_bar="off", builtin_tools=False, **cfg)
    result = asyncio.run(Agent(backend, tools, config).run("go"))
    check_messages(result.messages)
    assert result.final_text == "recovered" and result.stop_reason == "done"
    return [m["content"] for m in result.messages if m["role"] == "tool"], result


def test_unknown_tool_lists_the_available_ones():
    calls = []
    (text,), _ = run_one_turn([("get_wether", {"city": "Paris"})], [weather_tool(calls)])
    assert text.startswith("error: unknown tool 'get_wether'") and "get_weather" in text
    assert calls == []


def test_malformed_json_arguments_are_quoted_and_never_retried():
    calls = []
    (text,), result = run_one_turn([("get_weather", '{"city": "Par')], [weather_tool(calls)])
    assert "not valid JSON" in text and '{"city": "Par' in text and "city: string" in text
    assert calls == []
    assert result.turns[0].calls[0].result.attempts == 0
    # the history stays renderable: the malformed arguments are replaced by {}
    assistant = next(m for m in result.messages if m.get("tool_calls"))
    assert assistant["tool_calls"][0]["function"]["arguments"] == "{}"


def test_schema_violation_names_the_problem():
    calls = []
    texts, _ = run_one_turn([("get_weather", {"town": "Paris"}), ("get_weather", {"city": 42})],
                            [weather_tool(calls)])
    assert "'city' is a required property" in texts[0]
    assert "42 is not of type 'string'" in texts[1] and "at city" in texts[1]
    assert calls == []


def test_tool_that_raises_gives_its_error_once_without_retry():
    attempts = []

    def broken(city: str) -> str:
        attempts.append(city)
        raise ValueError("database row missing")

    (text,), _ = run_one_turn([("get_weather", {"city": "Paris"})], [Tool("get_weather", "w", CITY, broken)])
    assert text == "error: get_weather failed: ValueError: database row missing"
    assert attempts == ["Paris"]


def test_tool_that_hangs_times_out_and_is_retried_then_reported():
    async def hang(city: str) -> str:
        await asyncio.sleep(3600)

    tool = Tool("get_weather", "w", CITY, hang, timeout_s=0.05,
                retry=RetryPolicy(max_attempts=2, base_s=0.001, cap_s=0.001))
    (text,), result = run_one_turn([("get_weather", {"city": "Paris"})], [tool])
    assert text == "error: get_weather failed after 2 attempts: timed out after 0.05 s"
    assert result.turns[0].calls[0].result.error_kind == "timeout"


def test_call_without_a_name():
    (text,), _ = run_one_turn([("", {"city": "x"})], [weather_tool([])])
    assert "no function name" in text
