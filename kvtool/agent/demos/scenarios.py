"""Scripted scenarios for `kvtool agent --demo NAME`.

Each demo is a prompt for a real model plus a script of replies a model could give, so
the same scenario runs against a live endpoint or, deterministically, in tests. `during`
plays the outside world (a user who interrupts); `check` lists what went wrong.
Importing this module stays light: the agent itself is imported by demo_runner.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Awaitable, Callable

from kvtool.agent.demos.script import Reply, reply

if TYPE_CHECKING:
    from kvtool.agent.loop import Agent, AgentResult


@dataclass
class Demo:
    name: str
    description: str
    prompt: str
    script: Callable[[], list[Reply]]
    during: Callable[["Agent", float], Awaitable[None]] | None = None  # (agent, time scale)
    check: Callable[["AgentResult"], list[str]] = lambda result: []


DEMOS: dict[str, Demo] = {}


def demo(d: Demo) -> Demo:
    DEMOS[d.name] = d
    return d


def _calls(result: "AgentResult", name: str) -> list[dict]:
    return [c for m in result.messages if m.get("role") == "assistant"
            for c in m.get("tool_calls") or [] if c["function"]["name"] == name]


def _tool_texts(result: "AgentResult") -> list[str]:
    return [m["content"] for m in result.messages if m.get("role") == "tool"]


def _check_parallel(result: "AgentResult") -> list[str]:
    timed = [t for turn in result.turns for t in turn.timings() if t["started_ms"] is not None]
    weather = [t for t in timed if t["name"] == "get_weather"]
    if len(weather) < 2:
        return ["expected at least two get_weather calls in one run"]
    overlap = min(t["finished_ms"] for t in weather) > max(t["started_ms"] for t in weather)
    return [] if overlap else ["the weather lookups did not overlap in time"]


demo(Demo(
    "parallel",
    "Parallel time + weather lookups: four calls in one turn, each starts as soon as it is sealed.",
    "What time is it in Tokyo and in New York right now, and what is the weather in both cities? "
    "Look all four up at once.",
    lambda: [
        reply(reasoning="Four independent lookups; call them all in one turn.", tool_calls=[
            ("get_time", {"timezone": "Asia/Tokyo"}), ("get_time", {"timezone": "America/New_York"}),
            ("get_weather", {"city": "Tokyo"}), ("get_weather", {"city": "New York"})]),
        reply("Tokyo: sunny, 22 °C. New York: partly cloudy, 18 °C. Local times are in the tool results above."),
    ],
    check=_check_parallel,
))


def _check_limits(result: "AgentResult") -> list[str]:
    texts = _tool_texts(result)
    ran = [t for t in texts if "simulated call" in t]
    refused = [t for t in texts if "limit reached" in t]
    problems = [] if len(ran) == 3 else [f"expected 3 phone calls to run, {len(ran)} did"]
    statuses = [m["content"] for m in result.messages if m.get("content", "") and "<agent_status>" in m["content"]]
    if refused and not any("Xfinity 3/3 max" in s for s in statuses):
        problems.append("the status bar never showed 'Xfinity 3/3 max'")
    return problems


demo(Demo(
    "limits",
    "The three-calls limit: phone_call allows 3 calls per company; the 4th is refused and the status bar shows it.",
    "Xfinity's support line never answers. Call Xfinity with phone_call, one call at a time, until someone "
    "picks up or you are not allowed to call again, then tell me what happened.",
    lambda: [
        *[reply(tool_calls=[("phone_call", {"company": "Xfinity", "message": "My internet is down."})])
          for _ in range(4)],
        reply("I called Xfinity three times and nobody answered; the fourth call was refused because "
              "the limit is 3 calls per company. You may want to try their online chat."),
    ],
    check=_check_limits,
))


async def _wait_for_tool_start(agent: "Agent", name: str) -> None:
    while not (agent._turn and any(r.started_at and r.call.name == name for r in agent._turn.calls)):
        await asyncio.sleep(0.01)


async def _interrupt_after_start(agent: "Agent", scale: float) -> None:
    await _wait_for_tool_start(agent, "long_task")
    await asyncio.sleep(1.5 * scale)
    agent.interrupt("Quick question while that runs: what is 17 * 23?")


def _check_interrupt(result: "AgentResult") -> list[str]:
    problems = [] if any(t.interrupted for t in result.turns) else ["no turn was interrupted"]
    if not any(t.startswith("[cancelled") for t in _tool_texts(result)):
        problems.append("the interrupted long_task has no placeholder result")
    return problems


demo(Demo(
    "interrupt",
    "A long-running shell-like task interrupted by a user question: stream and tool are cancelled, the "
    "unfinished call gets a placeholder result, the question is answered.",
    "Run the full test suite with long_task (it takes about 20 seconds, label 'test suite') and report the result.",
    lambda: [
        reply(tool_calls=[("long_task", {"seconds": 20, "label": "test suite"})]),
        reply(reasoning="The user interrupted; answer the question.", tool_calls=[
            ("calculator", {"expression": "17 * 23"})]),
        reply("17 × 23 = 391. I stopped the test suite when you asked; say if I should start it again."),
    ],
    during=_interrupt_after_start,
    check=_check_interrupt,
))


def _check_background(result: "AgentResult") -> list[str]:
    problems = []
    if len(_calls(result, "start_job")) != 3:
        problems.append("expected three start_job calls")
    if not any("cancelled job-3" in t for t in _tool_texts(result)):
        problems.append("the slow job (job-3) was not cancelled")
    return problems


demo(Demo(
    "background",
    "Three background jobs at different speeds; when the first finishes, cancel the ones below 50%.",
    "Start three background jobs with start_job: label 'fast' (2 s), 'medium' (3 s) and 'slow' (12 s). "
    "When the first one finishes, check the others with job_status and cancel every job below 50% progress. "
    "Then wait for the rest and summarise.",
    lambda: [
        reply(tool_calls=[("start_job", {"seconds": 2, "label": "fast"}),
                          ("start_job", {"seconds": 3, "label": "medium"}),
                          ("start_job", {"seconds": 12, "label": "slow"})]),
        reply("All three jobs are running; I will check when the first one finishes."),
        reply(tool_calls=[("job_status", {"task_id": "job-2"}), ("job_status", {"task_id": "job-3"})]),
        reply("job-2 is past 50%, keeping it; job-3 is below, cancelling it.",
              tool_calls=[("cancel_job", {"task_id": "job-3"})]),
        reply("Waiting for job-2 to finish."),
        reply("fast and medium completed; slow was cancelled at the threshold."),
    ],
    check=_check_background,
))
