"""Shared fixtures: a real HTTP fake endpoint, and small tool factories."""

from __future__ import annotations

import asyncio

import pytest

from kvtool.agent.demos.fake_endpoint import FakeEndpoint
from kvtool.agent.tools import Tool

OBJ = {"type": "object", "properties": {}, "additionalProperties": True}


@pytest.fixture
def endpoint():
    """endpoint(script) -> a started FakeEndpoint; all are stopped after the test."""
    started: list[FakeEndpoint] = []

    def start(script) -> FakeEndpoint:
        ep = FakeEndpoint(script)
        ep.start()
        started.append(ep)
        return ep

    yield start
    for ep in started:
        ep.stop()


def sleeper(name: str, seconds: float, log: list | None = None, **opts) -> Tool:
    """An async tool that sleeps, then returns its name; logs (name, 'start'|'end')."""

    async def func(**kwargs):
        if log is not None:
            log.append((name, "start"))
        await asyncio.sleep(seconds)
        if log is not None:
            log.append((name, "end"))
        return f"{name} done"

    return Tool(name, f"sleeps {seconds} s", OBJ, func, **opts)


@pytest.fixture
def make_sleeper():
    return sleeper
