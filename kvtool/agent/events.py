"""One queue for everything that happens outside the model's own turn.

User messages, background-job completions, timers and external triggers wait here until
the agent reaches a safe point (no stream open, no tool running); then they enter the
context together as one user message. An urgent event does not wait: the agent watches
for it while streaming and running tools, and cancels the step.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass
from typing import Callable

# kind -> how the batch summary names it; unknown kinds are shown as-is
EVENT_KINDS: dict[str, str] = {
    "user": "user message",
    "job_done": "background job result",
    "tool_result": "tool result",
    "timer": "timer",
    "trigger": "external trigger",
}


@dataclass
class Event:
    kind: str
    text: str
    urgent: bool = False
    source: str = ""  # job id, timer id, trigger name

    def line(self) -> str:
        tag = self.kind if not self.source else f"{self.kind} {self.source}"
        return f"({tag}) {self.text}"


def user_message(text: str, urgent: bool = False) -> Event:
    return Event("user", text, urgent=urgent)


class EventQueue:
    def __init__(self) -> None:
        self._items: list[Event] = []
        self._signal = asyncio.Event()

    def put(self, event: Event) -> None:
        self._items.append(event)
        self._signal.set()

    def put_threadsafe(self, loop: asyncio.AbstractEventLoop, event: Event) -> None:
        loop.call_soon_threadsafe(self.put, event)

    def __len__(self) -> int:
        return len(self._items)

    def has_urgent(self) -> bool:
        return any(e.urgent for e in self._items)

    def drain(self) -> list[Event]:
        items, self._items = self._items, []
        return items

    async def _wait_for(self, pred: Callable[[], bool]) -> None:
        while not pred():
            self._signal.clear()
            await self._signal.wait()

    async def wait(self) -> None:
        await self._wait_for(lambda: bool(self._items))

    async def wait_urgent(self) -> None:
        await self._wait_for(self.has_urgent)


def _plural(label: str, n: int) -> str:
    return label if n == 1 else label + "s"


def format_batch(events: list[Event], interrupted: bool = False) -> str:
    """One user message: a summary line, then each event marked i/N."""
    kinds = Counter(e.kind for e in events)
    summary = ", ".join(f"{n} {_plural(EVENT_KINDS.get(k, k), n)}" for k, n in kinds.items())
    head = f"[{len(events)} {_plural('event', len(events))} arrived: {summary}]"
    if interrupted:
        head = "[Interrupted: the previous step was cancelled to handle this] " + head
    lines = [head]
    lines += [f"[Unprocessed event {i}/{len(events)}] {e.line()}" for i, e in enumerate(events, 1)]
    return "\n".join(lines)
