"""Streaming tool dispatch vs the classic loop (wait for the whole reply, then run tools
one by one), over real HTTP against the scripted fake endpoint.

Protocol: warm-up, repeated runs, median and spread, both variants in the same process,
a JSON record as the last line.  Usage: python benchmarks/agent_dispatch.py [--runs N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from kvtool.agent.config import AgentConfig
from kvtool.agent.demos.fake_endpoint import FakeEndpoint
from kvtool.agent.http_backend import OpenAIHTTPBackend
from kvtool.agent.loop import Agent
from kvtool.agent.sealing import CallAssembler
from kvtool.agent.demos.script import reply
from kvtool.agent.tools import Tool

TOOL_S = 0.3  # each simulated tool call
N_CALLS = 3
CALL_DELAY_S = 0.05  # between streamed chunks of a call: ~4 chunks per call


def tools() -> list[Tool]:
    async def lookup(key: str) -> str:
        await asyncio.sleep(TOOL_S)
        return f"value of {key}"

    return [Tool("lookup", "look a key up", {"type": "object", "properties": {"key": {"type": "string"}},
                                             "required": ["key"]}, lookup)]


def script() -> list:
    calls = [("lookup", {"key": f"k{i}"}) for i in range(N_CALLS)]
    return [reply(tool_calls=calls, call_delay_s=CALL_DELAY_S), reply("done")]


async def streaming_turn(base_url: str) -> tuple[float, float]:
    agent = Agent(OpenAIHTTPBackend(base_url, "fake-model"), tools(),
                  AgentConfig(status_bar="off", builtin_tools=False))
    t0 = time.perf_counter()
    result = await agent.run("go")
    turn = result.turns[0]
    gaps = [(r.started_at - r.call.sealed_at) * 1000 for r in turn.calls]
    return turn.t_end - t0, max(gaps)


async def classic_turn(base_url: str) -> float:
    """Baseline: read the whole stream, then run each call in turn."""
    backend = OpenAIHTTPBackend(base_url, "fake-model")
    t0 = time.perf_counter()
    assembler, calls = CallAssembler(), []
    async for delta in backend.stream([{"role": "user", "content": "go"}], [t.openai_schema() for t in tools()]):
        calls += assembler.feed(delta)
    calls += assembler.finish()
    lookup = tools()[0].func
    for call in calls:
        await lookup(**json.loads(call.arguments))
    elapsed = time.perf_counter() - t0
    async for _ in backend.stream([{"role": "user", "content": "go"}], []):  # consume the "done" reply
        pass
    return elapsed


def summary(xs: list[float]) -> dict:
    return {"median": round(statistics.median(xs), 4), "min": round(min(xs), 4), "max": round(max(xs), 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    stream_s, gap_ms, classic_s = [], [], []
    for i in range(args.runs + 1):  # run 0 is the warm-up
        with FakeEndpoint(script()) as ep:
            s, g = asyncio.run(streaming_turn(ep.base_url))
        with FakeEndpoint(script()) as ep:
            c = asyncio.run(classic_turn(ep.base_url))
        if i:
            stream_s.append(s), gap_ms.append(g), classic_s.append(c)
    record = {
        "benchmark": "agent_dispatch", "calls": N_CALLS, "tool_s": TOOL_S, "runs": args.runs,
        "streaming_turn_s": summary(stream_s), "classic_turn_s": summary(classic_s),
        "max_sealed_to_started_ms": summary(gap_ms),
        "speedup": round(statistics.median(classic_s) / statistics.median(stream_s), 2),
    }
    print(f"streaming dispatch: {record['streaming_turn_s']['median']:.3f} s per turn; "
          f"classic: {record['classic_turn_s']['median']:.3f} s; sealed->started max "
          f"{record['max_sealed_to_started_ms']['median']:.2f} ms (median over runs)")
    print(json.dumps(record))


if __name__ == "__main__":
    main()
