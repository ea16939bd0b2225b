"""Model-call retries, the trajectory checker, the calculator and the file sandbox."""

import asyncio
import os

import pytest

from kvtool.agent.backend import BackendError
from kvtool.agent.demos.calculator import calculate
from kvtool.agent.clock import FakeClock
from kvtool.agent.config import AgentConfig
from kvtool.agent.demos.tools import make_demo_tools
from kvtool.agent.loop import Agent
from kvtool.agent.retry import ToolInputError
from kvtool.agent.demos.script import http_error, reply
from kvtool.agent.demos.scripted import ScriptedBackend
from kvtool.agent.trajectory import message_problems
from kvtool.errors import InvalidParameterError, KvtoolError

CFG = AgentConfig(status_bar="off", builtin_tools=False)


def test_model_call_retried_on_503_with_backoff_on_the_fake_clock():
    clock = FakeClock()
    agent = Agent(ScriptedBackend([http_error(503), http_error(429), reply("ok")]), [], CFG, clock=clock)
    assert asyncio.run(agent.run("hi")).final_text == "ok"
    assert len(clock.sleeps) == 2 and clock.sleeps[0] <= 1.0 and clock.sleeps[1] <= 2.0


def test_model_call_not_retried_on_400_and_gives_up_after_3_attempts():
    clock = FakeClock()
    with pytest.raises(BackendError, match="400"):
        asyncio.run(Agent(ScriptedBackend([http_error(400, "bad")]), [], CFG, clock=clock).run("hi"))
    assert clock.sleeps == []
    with pytest.raises(BackendError, match="503"):
        asyncio.run(Agent(ScriptedBackend([http_error(503)] * 5), [], CFG, clock=clock).run("hi"))
    assert len(clock.sleeps) == 2


def test_unknown_placement_is_a_clear_error():
    with pytest.raises(InvalidParameterError, match="append, replace, off"):
        Agent(ScriptedBackend([]), [], AgentConfig(status_bar="sideways"))


def test_trajectory_checker_finds_unanswered_and_orphaned_calls():
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    ok = [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [call]},
          {"role": "tool", "tool_call_id": "c1", "content": "r"}]
    assert message_problems(ok) == []
    assert message_problems(ok[:2]) == ["message 1: tool call c1 is not answered by message 2"]
    assert "does not follow its call" in message_problems([ok[0], ok[2]])[0]
    bad_args = [ok[0], {**ok[1], "tool_calls": [{**call, "function": {"name": "f", "arguments": "{"}}]}, ok[2]]
    assert message_problems(bad_args) == ["message 1: tool call c1 arguments are not a JSON object"]


@pytest.mark.parametrize("expr,value", [("17 * 23", 391), ("2 ** 10", 1024), ("2^3", 8), ("sqrt(16) + -1", 3),
                                        ("(1 + 2) / 4", 0.75), ("max(3, 9) % 4", 1), ("round(pi, 2)", 3.14)])
def test_calculator(expr, value):
    assert calculate(expr) == value


@pytest.mark.parametrize("expr,msg", [
    ("__import__('os').system('true')", "unsupported"), ("().__class__", "unsupported"), ("x + 1", "unsupported"),
    ("9 ** 9 ** 9", "exponent too large"), ("1 / 0", "division by zero"), ("1 +", "cannot parse"),
    ("1" * 400, "limit is 300"), ("sqrt(x=4)", "unsupported"),
])
def test_calculator_refuses_unsafe_or_bad_input(expr, msg):
    with pytest.raises(ToolInputError, match=msg):
        calculate(expr)


def test_file_reader_is_confined_to_the_workspace(tmp_path):
    ws = tmp_path / "ws"
    (ws / "sub").mkdir(parents=True)
    (ws / "sub" / "a.txt").write_text("inside")
    (tmp_path / "secret.txt").write_text("outside")
    os.symlink(tmp_path / "secret.txt", ws / "link.txt")
    tools = {t.name: t.func for t in make_demo_tools(ws)}
    assert tools["read_file"]("sub/a.txt") == "inside"
    assert tools["list_files"]() == "link.txt\nsub/"
    for path in ["../secret.txt", str(tmp_path / "secret.txt"), "link.txt", "sub/../../secret.txt"]:
        with pytest.raises(ToolInputError, match="outside the workspace"):
            tools["read_file"](path)
    with pytest.raises(ToolInputError, match="no file"):
        tools["read_file"]("missing.txt")


def test_weather_and_time_tools():
    tools = {t.name: t.func for t in make_demo_tools(scale=0)}
    assert asyncio.run(tools["get_weather"]("paris")) == "Paris: 14 °C, light rain"
    with pytest.raises(ToolInputError, match="known cities"):
        asyncio.run(tools["get_weather"]("Atlantis"))
    assert "(Asia/Tokyo, UTC+0900)" in tools["get_time"]("Asia/Tokyo")
    with pytest.raises(ToolInputError, match="IANA"):
        tools["get_time"]("Mars/Olympus")


def test_duplicate_tool_names_are_refused():
    from kvtool.agent.tools import Tool, ToolRegistry

    t = Tool("x", "", {"type": "object"}, lambda: 1)
    with pytest.raises(KvtoolError, match="registered twice"):
        ToolRegistry([t, t])


def test_stream_that_drops_after_a_tool_ran_keeps_the_result_and_continues(endpoint):
    from kvtool.agent.http_backend import OpenAIHTTPBackend
    from kvtool.agent.demos.script import dropped
    from kvtool.agent.tools import Tool

    ran = []
    tool = Tool("note", "", {"type": "object", "properties": {"n": {"type": "integer"}}},
                lambda n: ran.append(n) or f"noted {n}")
    first = reply(tool_calls=[("note", {"n": 1}), ("note", {"n": 2})], delay_s=0.0)
    # steps: role, then per call a header and 3 argument pieces; cut after call 0 is complete
    ep = endpoint([dropped(first, 6), reply("continuing")])
    clock = FakeClock()
    agent = Agent(OpenAIHTTPBackend(ep.base_url, "m"), [tool], CFG, clock=clock)
    result = asyncio.run(agent.run("go"))
    assert ran == [1] and result.final_text == "continuing"
    assert message_problems(result.messages) == []
    assert "connection" in result.turns[0].warnings[0] or "stream failed" in result.turns[0].warnings[0]
    assert len(clock.sleeps) == 1


@pytest.mark.parametrize("answer_last", [False, True])
def test_last_iteration_can_withhold_tools_so_the_run_ends_in_an_answer(tmp_path, answer_last):
    clock_tool = [t for t in make_demo_tools(tmp_path, scale=0.01) if t.name == "get_time"]
    call = reply(tool_calls=[("get_time", {"timezone": "UTC"})])
    backend = ScriptedBackend([call, call, reply("It is noon.")])
    config = AgentConfig(status_bar="off", builtin_tools=False, max_iterations=3, answer_on_last_iteration=answer_last)
    result = asyncio.run(Agent(backend, clock_tool, config).run("time?"))
    offered = [bool(r.get("tools")) for r in backend.requests]
    assert offered == [True, True, not answer_last]
    assert result.final_text == "It is noon." and result.stop_reason == "done"
