"""Bad input from the model or a broken tool becomes a clear tool result; the loop goes on."""

import asyncio

import pytest

from kvtool.agent.config import AgentConfig
from kvtool.agent.loop import Agent
from kvtool.agent.retry import RetryPolicy
from kvtool.agent.demos.script import reply
from kvtool.agent.demos.scripted import ScriptedBackend
from kvtool.agent.tools import Tool
from kvtool.agent.trajectory import check_messages
from kvtool.errors import InvalidParameterError, KvtoolError

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


@pytest.mark.parametrize("settings,words", [
    (dict(max_iterations=0), "max_iterations=0: must be an integer >= 1"),  # it ran no model call and 'ended'
    (dict(max_iterations="3"), "max_iterations='3': must be an integer >= 1"),
    (dict(tool_timeout_s=-1), "tool_timeout_s=-1: must be a finite number of seconds > 0"),
    (dict(tool_timeout_s=float("nan")), "tool_timeout_s=nan"),
    (dict(tool_output_chars=0), "tool_output_chars=0: must be an integer >= 1"),
    (dict(breaker_threshold=0), "breaker_threshold=0"),
    (dict(breaker_cooldown_s=-1), "breaker_cooldown_s=-1: must be a finite number of seconds >= 0"),
    (dict(status_bar="bottom"), "status_bar='bottom': choose one of append, replace, off"),
    (dict(status_fields=["weather"]), r"status_fields=\['weather'\]: must be a list of status fields: time"),
    (dict(sampling=[0.2]), "sampling=\\[0.2\\]: must be a dict of sampling fields"),
    (dict(system_prompt=None), "system_prompt=None: must be a string"),
])
def test_agent_settings_are_checked_when_the_agent_is_built(settings, words):
    with pytest.raises(InvalidParameterError, match=words):
        Agent(ScriptedBackend([reply("hi")]), [], AgentConfig(**settings))


@pytest.mark.parametrize("kwargs,words", [
    (dict(max_attempts=0), "max_attempts must be an integer >= 1"),  # the loop reached an 'unreachable' assert
    (dict(base_s=-1.0), "base_s must be a finite number >= 0"),
    (dict(factor=0.5), "factor must be a finite number >= 1"),
    (dict(cap_s=float("inf")), "cap_s must be a finite number >= 0"),
])
def test_retry_policy_values_are_checked(kwargs, words):
    with pytest.raises(KvtoolError, match=words):
        RetryPolicy(**kwargs)


@pytest.mark.parametrize("change,words", [
    (dict(name="get weather"), "the name must be 1-64 letters, digits, '_', '-' or '.'"),
    (dict(name=""), "the name must be 1-64"),
    (dict(description=None), "the description must be a string, got NoneType"),
    (dict(parameters="city: str"), "parameters must be a JSON Schema object"),
    (dict(parameters={"type": "string"}), "parameters must be a JSON Schema object"),
    (dict(parameters={"type": "object", "properties": {"city": {"type": "text"}}}),
     "parameters is not a valid JSON Schema: .* \\(at properties/city/type\\)"),
    (dict(func=None), "func must be callable"),
    (dict(timeout_s=0), "timeout_s must be a finite number of seconds > 0 or None, got 0"),
    (dict(max_calls=0), "max_calls must be an integer >= 1 or None, got 0"),
])
def test_tool_declarations_are_checked(change, words):
    decl = dict(name="get_weather", description="weather", parameters=CITY, func=lambda city: city)
    with pytest.raises(KvtoolError, match=words):
        Tool(**{**decl, **change})


def test_tools_and_the_user_text_must_be_what_the_agent_takes():
    backend = ScriptedBackend([reply("hi")])
    with pytest.raises(InvalidParameterError, match="tools must be a list of Tool objects or a ToolRegistry; got Tool"):
        Agent(backend, weather_tool([]), AgentConfig(builtin_tools=False))
    with pytest.raises(KvtoolError, match="a ToolRegistry holds Tool objects; got str 'get_weather'"):
        Agent(backend, ["get_weather"], AgentConfig(builtin_tools=False))
    agent = Agent(backend, [weather_tool([])], AgentConfig(status_bar="off", builtin_tools=False))
    with pytest.raises(InvalidParameterError, match=r"run\(\) takes the user's text \(a str\) or None; got list"):
        asyncio.run(agent.run([{"role": "user", "content": "hi"}]))
    assert asyncio.run(agent.run("hi")).final_text == "hi"  # nothing was queued by the refused call
