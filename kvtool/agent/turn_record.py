"""What one model turn leaves behind: its text, its calls with their results, and their timings.

Pure data, so observers and renderers can name a Turn without importing the code that runs it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from kvtool.agent.backend import Usage
from kvtool.agent.dispatch import ToolResult
from kvtool.agent.sealing import SealedCall

PLACEHOLDER = ("[cancelled: interrupted before this call finished; it produced no result. "
               "Call it again if you still need it.]")


@dataclass
class CallRecord:
    call: SealedCall
    task: asyncio.Task
    started_at: float | None = None
    result: ToolResult | None = None

    def timings_ms(self, t0: float) -> dict[str, Any]:
        ms = lambda t: None if t is None else round((t - t0) * 1000, 2)  # noqa: E731
        done = self.result.finished_at if self.result else None
        return {"name": self.call.name, "id": self.call.id, "sealed_ms": ms(self.call.sealed_at),
                "started_ms": ms(self.started_at), "finished_ms": ms(done)}


@dataclass
class Turn:
    index: int
    reasoning: str = ""
    content: str = ""
    calls: list[CallRecord] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage | None = None
    interrupted: bool = False
    warnings: list[str] = field(default_factory=list)  # stream anomalies worth showing, not fatal
    t_start: float = field(default_factory=time.perf_counter)
    t_first_delta: float | None = None
    t_stream_end: float | None = None
    t_end: float | None = None

    def record(self, call_id: str) -> CallRecord | None:
        return next((r for r in self.calls if r.call.id == call_id), None)

    def assistant_message(self) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": self.content or None}
        if self.calls:
            msg["tool_calls"] = [r.call.as_message_call() for r in self.calls]
        return msg

    def tool_messages(self) -> list[dict[str, Any]]:
        """One per call, in call order; unfinished calls get a placeholder."""
        return [
            r.result.message() if r.result else {"role": "tool", "tool_call_id": r.call.id, "content": PLACEHOLDER}
            for r in self.calls
        ]

    def timings(self) -> list[dict[str, Any]]:
        return [r.timings_ms(self.t_start) for r in self.calls]
