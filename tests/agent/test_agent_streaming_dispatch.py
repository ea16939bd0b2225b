"""Acceptance: tools start while the model streams, run in parallel, answer in call order."""

import asyncio
import time

from kvtool.agent.config import AgentConfig
from kvtool.agent.http_backend import OpenAIHTTPBackend
from kvtool.agent.loop import Agent
from kvtool.agent.demos.script import reply
from kvtool.agent.demos.scripted import ScriptedBackend
from kvtool.agent.trajectory import check_messages

CFG = AgentConfig(status_bar="off", builtin_tools=False)


def test_first_tool_starts_within_5ms_of_sealing_and_before_the_stream_ends(endpoint, make_sleeper):
    # two calls; the second call's arguments keep streaming for ~200 ms after the first is sealed
    ep = endpoint([
        reply(tool_calls=[("fast", {"n": 1}), ("fast2", {"n": 2})], call_delay_s=0.05, arg_pieces=4),
        reply("done"),
    ])
    tools = [make_sleeper("fast", 0.01), make_sleeper("fast2", 0.01)]
    agent = Agent(OpenAIHTTPBackend(ep.base_url, "fake-model"), tools, CFG)
    result = asyncio.run(agent.run("go"))
    turn = result.turns[0]
    first = turn.calls[0]
    gap_ms = (first.started_at - first.call.sealed_at) * 1000
    assert gap_ms <= 5.0, f"sealed -> started took {gap_ms:.2f} ms"
    assert first.started_at < turn.t_stream_end
    assert turn.t_stream_end - first.started_at > 0.1  # started well before the end, not just barely
    check_messages(result.messages)


def test_two_one_second_tools_in_one_turn_finish_within_1_3_s(make_sleeper):
    backend = ScriptedBackend([reply(tool_calls=[("slow_a", {}), ("slow_b", {})]), reply("ok")])
    agent = Agent(backend, [make_sleeper("slow_a", 1.0), make_sleeper("slow_b", 1.0)], CFG)
    t0 = time.perf_counter()
    result = asyncio.run(agent.run("go"))
    turn = result.turns[0]
    tools_wall = max(r.result.finished_at for r in turn.calls) - min(r.started_at for r in turn.calls)
    assert tools_wall <= 1.3, f"tools took {tools_wall:.2f} s"
    assert time.perf_counter() - t0 < 1.6
    assert result.final_text == "ok"


def test_results_enter_the_trajectory_in_call_order_not_finish_order(make_sleeper):
    log = []
    tools = [make_sleeper("slowest", 0.15, log), make_sleeper("middle", 0.08, log), make_sleeper("fastest", 0.01, log)]
    backend = ScriptedBackend([reply(tool_calls=[("slowest", {}), ("middle", {}), ("fastest", {})]), reply("ok")])
    result = asyncio.run(Agent(backend, tools, CFG).run("go"))
    ends = [name for name, what in log if what == "end"]
    assert ends == ["fastest", "middle", "slowest"]
    assistant = next(m for m in result.messages if m.get("tool_calls"))
    tool_msgs = [m for m in result.messages if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in tool_msgs] == [c["id"] for c in assistant["tool_calls"]]
    assert ["slowest" in tool_msgs[0]["content"], "fastest" in tool_msgs[2]["content"]] == [True, True]
    check_messages(result.messages)


def test_non_concurrent_tool_runs_alone_in_order(make_sleeper):
    log = []
    tools = [make_sleeper("a", 0.05, log), make_sleeper("exclusive", 0.05, log, concurrent_safe=False),
             make_sleeper("b", 0.05, log)]
    backend = ScriptedBackend([reply(tool_calls=[("a", {}), ("exclusive", {}), ("b", {})], delay_s=0.0), reply("ok")])
    asyncio.run(Agent(backend, tools, CFG).run("go"))
    assert log == [("a", "start"), ("a", "end"), ("exclusive", "start"), ("exclusive", "end"),
                   ("b", "start"), ("b", "end")]


def test_independent_tools_overlap(make_sleeper):
    log = []
    backend = ScriptedBackend([reply(tool_calls=[("a", {}), ("b", {})], delay_s=0.0), reply("ok")])
    asyncio.run(Agent(backend, [make_sleeper("a", 0.05, log), make_sleeper("b", 0.05, log)], CFG).run("go"))
    assert log[:2] == [("a", "start"), ("b", "start")]
