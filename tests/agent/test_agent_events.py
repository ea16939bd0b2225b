"""Event queue, safe points, urgent interrupts, background jobs and timers."""

import asyncio
import time

from kvtool.agent.config import AgentConfig
from kvtool.agent.events import Event, EventQueue, format_batch, user_message
from kvtool.agent.loop import Agent
from kvtool.agent.demos.script import reply
from kvtool.agent.demos.scripted import ScriptedBackend
from kvtool.agent.tools import Tool
from kvtool.agent.trajectory import check_messages, message_problems
from kvtool.agent.turn_record import PLACEHOLDER

CFG = AgentConfig(status_bar="off")


def test_batch_has_a_summary_line_and_numbered_markers():
    text = format_batch([user_message("hi"), Event("job_done", "job-1 finished", source="job-1"),
                         Event("job_done", "job-2 finished", source="job-2")])
    assert text.splitlines() == [
        "[3 events arrived: 1 user message, 2 background job results]",
        "[Unprocessed event 1/3] (user) hi",
        "[Unprocessed event 2/3] (job_done job-1) job-1 finished",
        "[Unprocessed event 3/3] (job_done job-2) job-2 finished",
    ]


def test_queue_wait_urgent_ignores_non_urgent_events():
    async def main():
        q = EventQueue()
        waiter = asyncio.create_task(q.wait_urgent())
        q.put(user_message("later"))
        await asyncio.sleep(0.01)
        assert not waiter.done()
        q.put(user_message("stop!", urgent=True))
        await asyncio.wait_for(waiter, 1)
        return [e.text for e in q.drain()]

    assert asyncio.run(main()) == ["later", "stop!"]


def test_non_urgent_events_wait_for_the_safe_point_and_arrive_together(make_sleeper):
    async def main():
        backend = ScriptedBackend([reply(tool_calls=[("work", {})]), reply("all handled")])
        agent = Agent(backend, [make_sleeper("work", 0.1)], CFG)
        run = asyncio.create_task(agent.run("start"))
        await asyncio.sleep(0.05)  # the tool is running: these must not interrupt it
        agent.submit(user_message("also check the mail"))
        agent.submit(Event("trigger", "deploy finished", source="ci"))
        return agent, await run

    agent, result = asyncio.run(main())
    check_messages(result.messages)
    tool = next(m for m in result.messages if m["role"] == "tool")
    assert "work done" in tool["content"]  # the tool finished normally
    batch = result.messages[result.messages.index(tool) + 1]
    assert batch["role"] == "user" and batch["content"].startswith("[2 events arrived: 1 user message, 1 external")
    assert "[Unprocessed event 2/2] (trigger ci) deploy finished" in batch["content"]
    assert backend_saw(agent, "[Unprocessed event 1/2] (user) also check the mail")


def backend_saw(agent, text):
    return any(text in (m.get("content") or "") for m in agent.backend.requests[-1]["messages"])


def test_interrupt_during_tools_writes_placeholders_and_calls_the_model_again(make_sleeper):
    async def main():
        backend = ScriptedBackend([
            reply(tool_calls=[("quick", {}), ("slow", {}), ("slower", {})]),
            reply("Answering your question instead."),
        ])
        agent = Agent(backend, [make_sleeper("quick", 0.0), make_sleeper("slow", 30), make_sleeper("slower", 30)],
                      CFG)
        run = asyncio.create_task(agent.run("do three things"))
        while not (agent._turn and all(r.started_at for r in agent._turn.calls) and len(agent._turn.calls) == 3):
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.02)
        agent.interrupt("stop, what time is it?")
        return await asyncio.wait_for(run, 5)

    result = asyncio.run(main())
    assert message_problems(result.messages) == []
    tools = [m["content"] for m in result.messages if m["role"] == "tool"]
    assert "quick done" in tools[0] and tools[1] == PLACEHOLDER and tools[2] == PLACEHOLDER
    interrupt = [m for m in result.messages if m["role"] == "user"][-1]["content"]
    assert interrupt.startswith("[Interrupted") and "stop, what time is it?" in interrupt
    assert result.turns[0].interrupted and result.final_text == "Answering your question instead."


def test_interrupt_mid_stream_cancels_the_stream_and_drops_unsealed_calls(endpoint, make_sleeper):
    from kvtool.agent.http_backend import OpenAIHTTPBackend

    ep = endpoint([
        reply("Let me look that up. " * 3, tool_calls=[("a", {"x": 1}), ("b", {"y": 2})], call_delay_s=0.1),
        reply("ok, stopped."),
    ])

    async def main():
        agent = Agent(OpenAIHTTPBackend(ep.base_url, "m"), [make_sleeper("a", 0.0), make_sleeper("b", 0.0)], CFG)
        run = asyncio.create_task(agent.run("go"))
        while not (agent._turn and agent._turn.calls):  # call a sealed and dispatched, b not yet
            await asyncio.sleep(0.005)
        agent.interrupt("never mind")
        return await asyncio.wait_for(run, 5)

    result = asyncio.run(main())
    check_messages(result.messages)
    assistant = next(m for m in result.messages if m["role"] == "assistant")
    assert [c["function"]["name"] for c in assistant["tool_calls"]] == ["a"]
    assert assistant["content"].startswith("Let me look that up.")
    assert result.final_text == "ok, stopped."
    for _ in range(100):
        if ep.disconnects:
            break
        time.sleep(0.01)
    assert ep.disconnects == 1  # the server saw the stream closed


def test_background_job_returns_an_id_and_its_result_arrives_as_an_event():
    async def slow_report(ctx):
        ctx.progress(0.5, "halfway")
        await asyncio.sleep(0.1)
        return "report ready"

    tool = Tool("make_report", "bg", {"type": "object", "properties": {}}, slow_report, background=True)
    script = [
        reply(tool_calls=[("make_report", {}), ("make_report", {})]),
        reply(tool_calls=[("job_status", {"task_id": "job-1"}), ("cancel_job", {"task_id": "job-2"})]),
        reply("waiting"),
        reply("got it"),
    ]
    agent = Agent(ScriptedBackend(script), [tool], CFG)
    result = asyncio.run(agent.run("go"))
    check_messages(result.messages)
    tools = [m["content"] for m in result.messages if m["role"] == "tool"]
    assert "started background job job-1" in tools[0] and "task_id 'job-2'" in tools[1]
    assert "job-1 make_report: running 50%" in tools[2] and "(halfway)" in tools[2]
    assert tools[3].startswith("<external_content") and "cancelled job-2" in tools[3]
    event = result.messages[-2]["content"]
    assert "[Unprocessed event 1/1] (job_done job-1) job-1 make_report: completed 100%" in event
    assert "report ready" in event
    assert result.final_text == "got it" and agent.jobs.jobs["job-2"].state == "cancelled"


def test_timer_fires_as_an_event():
    script = [reply(tool_calls=[("set_timer", {"seconds": 0.05, "note": "check the oven"})]),
              reply("I'll wait."), reply("Oven checked.")]
    result = asyncio.run(Agent(ScriptedBackend(script), [], CFG).run("remind me"))
    check_messages(result.messages)
    assert "timer fired: check the oven" in result.messages[-2]["content"]
    assert result.final_text == "Oven checked."


def test_max_iterations_bounds_the_loop():
    script = [reply(tool_calls=[("calculator", {"expression": "1"})]) for _ in range(10)]
    tool = Tool("calculator", "", {"type": "object"}, lambda expression: expression)
    result = asyncio.run(Agent(ScriptedBackend(script), [tool], AgentConfig(status_bar="off", max_iterations=3))
                         .run("loop"))
    assert result.stop_reason == "max_iterations" and len(result.turns) == 3
    check_messages(result.messages)
