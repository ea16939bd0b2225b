"""Run a registered demo against any backend: a live endpoint or the demo's own script."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from pathlib import Path

from kvtool.agent.backend import ChatBackend
from kvtool.agent.config import AgentConfig
from kvtool.agent.demos.tools import make_demo_tools
from kvtool.agent.demos.scenarios import DEMOS, Demo
from kvtool.agent.loop import Agent, AgentResult
from kvtool.agent.observer import Observer
from kvtool.agent.demos.scripted import ScriptedBackend
from kvtool.errors import KvtoolError


def get_demo(name: str) -> Demo:
    if name not in DEMOS:
        raise KvtoolError(f"unknown demo {name!r}; choose one of {', '.join(DEMOS)}")
    return DEMOS[name]


def scripted_backend(name: str) -> ScriptedBackend:
    """The demo's own replies, for a run without a model."""
    return ScriptedBackend(get_demo(name).script())


async def run_demo(
    name: str,
    backend: ChatBackend,
    config: AgentConfig | None = None,
    *,
    scale: float = 1.0,
    workspace: str | Path | None = None,
    observer: Observer | None = None,
) -> AgentResult:
    """`scale` multiplies every simulated duration (tests use ~0.05)."""
    d = get_demo(name)
    config = config or AgentConfig()
    with contextlib.ExitStack() as stack:
        root = workspace or stack.enter_context(tempfile.TemporaryDirectory(prefix="kvtool-agent-"))
        agent = Agent(backend, make_demo_tools(root, scale=scale), config, observer=observer)
        during = asyncio.create_task(d.during(agent, scale)) if d.during else None
        try:
            return await agent.run(d.prompt)
        finally:
            if during:
                during.cancel()
                await asyncio.gather(during, return_exceptions=True)
            await agent.aclose()
