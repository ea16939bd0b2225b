"""Hooks for watching an agent live (terminal UI, tests, benchmarks). All no-ops here."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtool.agent.dispatch import ToolResult
    from kvtool.agent.events import Event
    from kvtool.agent.sealing import SealedCall
    from kvtool.agent.turn_record import Turn


class Observer:
    def turn_started(self, turn: "Turn") -> None: ...

    def reasoning(self, text: str) -> None: ...

    def content(self, text: str) -> None: ...

    def tool_sealed(self, call: "SealedCall") -> None: ...

    def tool_started(self, call: "SealedCall", t: float) -> None: ...

    def tool_finished(self, call: "SealedCall", result: "ToolResult") -> None: ...

    def turn_finished(self, turn: "Turn") -> None: ...

    def events_absorbed(self, events: "list[Event]", interrupted: bool) -> None: ...

    def retrying_model(self, error: Exception, delay_s: float) -> None: ...
