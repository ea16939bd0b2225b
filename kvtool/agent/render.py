"""Live terminal view of an agent: reasoning (dim), content, tool activity with timings."""

from __future__ import annotations

import re
import sys
import time
from typing import TYPE_CHECKING, TextIO

from kvtool.agent.observer import Observer

if TYPE_CHECKING:
    from kvtool.agent.dispatch import ToolResult
    from kvtool.agent.events import Event
    from kvtool.agent.sealing import SealedCall
    from kvtool.agent.turn_record import Turn

_FENCE = re.compile(r"</?external_content[^>]*>")


def preview(text: str, width: int = 100) -> str:
    flat = " ".join(_FENCE.sub("", text).split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"


class TerminalObserver(Observer):
    def __init__(self, out: TextIO | None = None, color: bool | None = None):
        self.out = out or sys.stdout
        self.color = self.out.isatty() if color is None else color
        self._t0 = time.perf_counter()
        self._mode = ""  # "reasoning" | "content" | "": what the current line is printing

    def _style(self, text: str, code: str) -> str:
        return f"\033[{code}m{text}\033[0m" if self.color else text

    def _t(self, t: float | None = None) -> str:
        return f"+{(t or time.perf_counter()) - self._t0:.2f}s"

    def _line(self, text: str) -> None:
        if self._mode:
            self.out.write("\n")
            self._mode = ""
        self.out.write(text + "\n")
        self.out.flush()

    def _stream(self, mode: str, text: str, label: str, code: str) -> None:
        if self._mode != mode:
            if self._mode:
                self.out.write("\n")
            self.out.write(self._style(label, code))
            self._mode = mode
        self.out.write(self._style(text, code) if mode == "reasoning" else text)
        self.out.flush()

    def turn_started(self, turn: "Turn") -> None:
        self._t0 = turn.t_start
        self._line(self._style(f"── model call {turn.index + 1} ──", "2"))

    def reasoning(self, text: str) -> None:
        self._stream("reasoning", text, "thinking: ", "2;3")

    def content(self, text: str) -> None:
        self._stream("content", text, "", "0")

    def tool_sealed(self, call: "SealedCall") -> None:
        self._line(self._style(f"  ⚙ {call.name}({preview(call.arguments, 80)}) sealed {self._t(call.sealed_at)}", "36"))

    def tool_started(self, call: "SealedCall", t: float) -> None:
        gap_ms = (t - call.sealed_at) * 1000
        self._line(self._style(f"  ▶ {call.name} started {self._t(t)} ({gap_ms:.1f} ms after sealing)", "36"))

    def tool_finished(self, call: "SealedCall", result: "ToolResult") -> None:
        took = result.finished_at - (result.started_at or call.sealed_at)
        mark, code = ("✓", "32") if result.ok else ("✗", "31")
        retries = f", {result.attempts} attempts" if result.attempts > 1 else ""
        self._line(self._style(f"  {mark} {call.name} {took:.2f} s{retries}: {preview(result.content)}", code))

    def turn_finished(self, turn: "Turn") -> None:
        parts = [f"{(turn.t_end or time.perf_counter()) - turn.t_start:.2f} s"]
        if turn.t_first_delta:
            parts.append(f"first token {turn.t_first_delta - turn.t_start:.2f} s")
        if turn.usage:
            u = turn.usage
            parts.append(f"prompt {u.prompt_tokens} tok")
            if u.cache_hit_rate is not None:
                parts.append(f"cached {u.cached_tokens} ({u.cache_hit_rate:.0%})")
        if turn.interrupted:
            parts.append("INTERRUPTED")
        self._line(self._style("  [" + ", ".join(parts) + "]", "2"))
        for warning in turn.warnings:
            self._line(self._style(f"  warning: {warning}", "31"))

    def events_absorbed(self, events: "list[Event]", interrupted: bool) -> None:
        head = "  ⚡ interrupt" if interrupted else f"  ✉ {len(events)} event(s)"
        for e in events:
            self._line(self._style(f"{head}: {preview(e.line())}", "33"))

    def retrying_model(self, error: Exception, delay_s: float) -> None:
        self._line(self._style(f"  model call failed ({error}); retrying in {delay_s:.1f} s", "31"))
