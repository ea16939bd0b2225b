"""The weather task the real-model agent tests run, in process and through `kvtool serve`."""

from __future__ import annotations

import asyncio
from pathlib import Path

WEATHER_PROMPT = "What is the weather in Paris right now? Use the get_weather tool."


def run_weather_task(backend, workdir: Path, **config):
    """Run the agent with the get_weather demo tool on WEATHER_PROMPT (greedy); return (result, calls)."""
    from kvtool.agent import Agent, AgentConfig, check_messages, make_demo_tools

    cfg = AgentConfig(**{"max_iterations": 3, "status_bar": "off", "builtin_tools": False,
                         "wait_for_background": False, "sampling": {"temperature": 0, "max_tokens": 96},
                         "workdir": str(workdir), **config})
    agent = Agent(backend, [t for t in make_demo_tools(workdir, scale=0.01) if t.name == "get_weather"], cfg)

    async def run():
        try:
            return await agent.run(WEATHER_PROMPT)
        finally:
            await agent.aclose()

    result = asyncio.run(run())
    calls = [c for m in result.messages for c in m.get("tool_calls") or []]
    if not calls or calls[0]["function"]["name"] != "get_weather" or "paris" not in calls[0]["function"][
            "arguments"].lower():
        raise AssertionError(f"expected a get_weather call for Paris first; got {calls}")
    answered = {m["tool_call_id"] for m in result.messages if m["role"] == "tool"}
    if not {c["id"] for c in calls} <= answered:
        raise AssertionError(f"unanswered tool calls: {[c['id'] for c in calls if c['id'] not in answered]}")
    check_messages(result.messages)
    return result, calls


def check_answered(result) -> None:
    """After run_weather_task: the tool ran for Paris without an error, and the last message is a text answer."""
    results = [m for m in result.messages if m["role"] == "tool"]
    if not any("Paris" in m["content"] and "error" not in m["content"].lower() for m in results):
        raise AssertionError(f"no get_weather result for Paris: {results}")
    final = result.messages[-1]
    if final["role"] != "assistant" or final.get("tool_calls") or not (final["content"] or "").strip():
        raise AssertionError(f"the run did not end with a text answer: {final}")
