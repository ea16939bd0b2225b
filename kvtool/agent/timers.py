"""`set_timer`: the model asks to be woken later; the wake-up arrives as an event."""

from __future__ import annotations

import asyncio
import itertools

from kvtool.agent.clock import Clock
from kvtool.agent.events import Event, EventQueue
from kvtool.agent.tools import Tool


class Timers:
    def __init__(self, events: EventQueue, clock: Clock):
        self.events = events
        self.clock = clock
        self._tasks: dict[str, asyncio.Task] = {}
        self._ids = itertools.count(1)

    def set(self, seconds: float, note: str = "") -> str:
        timer_id = f"timer-{next(self._ids)}"

        async def fire() -> None:
            await self.clock.sleep(seconds)
            self._tasks.pop(timer_id, None)
            self.events.put(Event("timer", f"{seconds:g} s timer fired: {note or '(no note)'}", source=timer_id))

        self._tasks[timer_id] = asyncio.create_task(fire())
        return timer_id

    def pending(self) -> int:
        return len(self._tasks)

    def cancel_all(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        self._tasks.clear()

    def tools(self) -> list[Tool]:
        async def set_timer(seconds: float, note: str = "") -> str:  # async: touches the loop
            timer_id = self.set(seconds, note)
            return f"{timer_id} set: you will get an event in {seconds:g} s"

        return [
            Tool(
                "set_timer",
                "Get a timer event after some seconds (to check on something later).",
                {
                    "type": "object",
                    "properties": {
                        "seconds": {"type": "number", "minimum": 0, "maximum": 86400},
                        "note": {"type": "string", "description": "what to do when it fires"},
                    },
                    "required": ["seconds"],
                },
                set_timer,
                concurrent_safe=True,
            )
        ]
