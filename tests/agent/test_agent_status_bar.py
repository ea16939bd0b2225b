"""The <agent_status> message: content, TODO tools, placements and their cache cost."""

import asyncio
from datetime import datetime, timezone

from kvtool.agent.clock import FakeClock
from kvtool.agent.config import AgentConfig
from kvtool.agent.demos.tools import make_demo_tools
from kvtool.agent.loop import Agent
from kvtool.agent.demos.script import reply
from kvtool.agent.demos.scripted import ScriptedBackend
from kvtool.agent.status_bar import STATUS_FIELDS, StatusSnapshot, format_elapsed, is_status_message, render_status
from kvtool.agent.trajectory import check_messages


def statuses(messages):
    return [m["content"] for m in messages if is_status_message(m)]


def test_render_has_every_field_as_short_key_value_lines():
    snap = StatusSnapshot(now=datetime(2025, 3, 1, 9, 30, 5, tzinfo=timezone.utc), elapsed_s=65,
                          call_lines=["phone_call: 3 (Xfinity 3/3 max)"], todo_lines=["[~] 1. fix (in_progress)"],
                          cwd="/work", os="Linux 6.1", last_error="get_weather: timed out after 10 s")
    assert render_status(snap) == "\n".join([
        "<agent_status>", "time: 2025-03-01 09:30:05 UTC", "elapsed: 1m 05s",
        "tool calls:", "  phone_call: 3 (Xfinity 3/3 max)", "todo:", "  [~] 1. fix (in_progress)",
        "working directory: /work", "os: Linux 6.1", "last error: get_weather: timed out after 10 s",
        "</agent_status>"])
    assert set(STATUS_FIELDS) >= {"time", "elapsed", "tool_calls", "todo", "cwd", "os", "last_error", "jobs"}
    assert format_elapsed(3725) == "1h 02m 05s" and format_elapsed(9) == "9s"


def run_agent(script, placement="append", clock=None, **cfg):
    agent = Agent(ScriptedBackend(script), make_demo_tools(scale=0.01),
                  AgentConfig(status_bar=placement, workdir="/ws", **cfg), clock=clock)
    result = asyncio.run(agent.run("go"))
    check_messages(result.messages)
    return agent, result


def test_counts_limits_todo_time_and_last_error_reach_the_model():
    clock = FakeClock()
    script = [
        reply(tool_calls=[("rewrite_todo_list", {"items": ["call Xfinity", "report back"]})]),
        reply(tool_calls=[("update_todo_status", {"item_id": 1, "status": "in_progress"})]),
        *[reply(tool_calls=[("phone_call", {"company": "Xfinity"})]) for _ in range(4)],
        reply(tool_calls=[("update_todo_status", {"item_id": 9, "status": "completed"})]),
        reply("done"),
    ]
    agent, result = run_agent(script, clock=clock)
    last = statuses(result.messages)[-1]
    assert "phone_call: 3 (Xfinity 3/3 max)" in last
    assert "[~] 1. call Xfinity (in_progress)" in last and "[ ] 2. report back (pending)" in last
    assert "time: 2025-01-01 12:00:00 UTC" in last and "working directory: /ws" in last
    assert "last error: update_todo_status: no TODO item 9; item ids are 1, 2" in last
    first = statuses(result.messages)[0]
    assert "tool calls: none yet" in first and "todo: empty" in first


def test_append_adds_one_status_per_model_call_and_keeps_old_ones():
    script = [reply(tool_calls=[("calculator", {"expression": "1+1"})]) for _ in range(3)] + [reply("ok")]
    agent, result = run_agent(script, "append")
    assert len(statuses(result.messages)) == 4
    requests = agent.backend.requests
    # every request extends the previous one: the prefix never changes
    for prev, cur in zip(requests, requests[1:]):
        assert cur["messages"][: len(prev["messages"])] == prev["messages"]
        assert is_status_message(cur["messages"][-1])


def test_replace_keeps_exactly_one_status_at_the_end():
    script = [reply(tool_calls=[("calculator", {"expression": "1+1"})]) for _ in range(3)] + [reply("ok")]
    agent, result = run_agent(script, "replace")
    for req in agent.backend.requests:
        assert len(statuses(req["messages"])) == 1 and is_status_message(req["messages"][-1])


def test_off_sends_no_status():
    agent, result = run_agent([reply("ok")], "off")
    assert statuses(result.messages) == []


def test_append_gets_a_higher_prefix_cache_hit_rate_than_replace():
    script = lambda: [reply(tool_calls=[("calculator", {"expression": f"{i}*2"})]) for i in range(5)] + [reply("ok")]
    rates = {p: run_agent(script(), p)[1].cache_hit_rate for p in ("append", "replace")}
    assert rates["append"] > rates["replace"] > 0, rates
