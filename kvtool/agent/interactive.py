"""The interactive terminal session behind `kvtool agent`.

Input is read on a thread so typing works while the agent streams: a plain line becomes
a queued user event, a line starting with '!' (or Ctrl-C) is an urgent interrupt.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
from typing import Callable

from kvtool.agent.backend import ChatBackend
from kvtool.agent.config import AgentConfig
from kvtool.agent.demos.tools import make_demo_tools
from kvtool.agent.events import user_message
from kvtool.agent.loop import Agent
from kvtool.agent.observer import Observer
from kvtool.agent.status_bar import render_status


def _start_reader(loop: asyncio.AbstractEventLoop, lines: asyncio.Queue, readline: Callable[[], str]) -> None:
    def pump() -> None:
        while True:
            line = readline()
            try:
                loop.call_soon_threadsafe(lines.put_nowait, line.rstrip("\n") if line else None)
            except RuntimeError:  # the session ended (loop closed) while we waited for input
                return
            if not line:
                return

    threading.Thread(target=pump, name="agent-stdin", daemon=True).start()


def _command(line: str | None, agent: Agent, config: AgentConfig) -> bool | None:
    """True: quit; False: handled (or nothing to do); None: a message for the agent."""
    if line is None or line.strip() in ("/exit", "/quit"):
        return True
    if line.strip() == "/status":
        print(render_status(agent.status_snapshot(), config.status_fields), flush=True)
        return False
    return False if not line.strip() else None


async def interactive_session(
    backend: ChatBackend,
    config: AgentConfig,
    observer: Observer,
    workspace: str = ".",
    readline: Callable[[], str] = sys.stdin.readline,
    extra_tools: list | None = None,
) -> int:
    agent = Agent(backend, [*make_demo_tools(workspace), *(extra_tools or [])], config, observer=observer)
    loop = asyncio.get_running_loop()
    lines: asyncio.Queue[str | None] = asyncio.Queue()
    _start_reader(loop, lines, readline)
    running: asyncio.Task | None = None

    def on_sigint() -> None:
        if running and not running.done():
            agent.interrupt("[The user pressed Ctrl-C: stop what you are doing and ask what they want.]")
        else:
            lines.put_nowait(None)

    try:
        loop.add_signal_handler(signal.SIGINT, on_sigint)
    except (NotImplementedError, RuntimeError):  # Windows, or not the main thread
        pass
    print("kvtool agent — type a message; '!text' interrupts, /status, /exit", flush=True)
    try:
        while True:
            print("\nyou> ", end="", flush=True)
            line = await lines.get()
            if _command(line, agent, config) is not None:
                if _command(line, agent, config):
                    return 0
                continue
            running = asyncio.create_task(agent.run(line))
            while not running.done():
                get = asyncio.create_task(lines.get())
                await asyncio.wait({running, get}, return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    get.cancel()
                    continue
                text = get.result()
                if _command(text, agent, config):  # /exit or end of input: stop the run, then leave
                    running.cancel()
                    await asyncio.gather(running, return_exceptions=True)
                    return 0
                if text.startswith("!"):
                    agent.interrupt(text[1:].strip())
                elif text.strip() and not text.startswith("/"):
                    agent.submit(user_message(text))
            result = running.result()
            rate = result.cache_hit_rate
            print(f"\n[{result.stop_reason}; {len(result.turns)} model calls"
                  + (f"; prefix-cache hit rate {rate:.0%}" if rate is not None else "") + "]", flush=True)
    finally:
        try:
            loop.remove_signal_handler(signal.SIGINT)
        except (NotImplementedError, RuntimeError):
            pass
        await agent.aclose()
