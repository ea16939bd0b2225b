"""Per-tool and per-target call counts against their limits (shown in the status bar)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from kvtool.agent.tools import Tool


class CallCounter:
    def __init__(self) -> None:
        self.per_tool: Counter[str] = Counter()
        self.per_target: dict[str, Counter[str]] = {}
        self._limits: dict[str, Tool] = {}

    @staticmethod
    def target_of(tool: Tool, args: dict[str, Any]) -> str | None:
        if tool.target_arg is None or args.get(tool.target_arg) is None:
            return None
        return str(args[tool.target_arg]).strip()

    def refusal(self, tool: Tool, args: dict[str, Any]) -> str | None:
        """Why this call would exceed a limit, or None if it may run."""
        if tool.max_calls is not None and self.per_tool[tool.name] >= tool.max_calls:
            return (f"limit reached: {tool.name} has been called {self.per_tool[tool.name]}/{tool.max_calls} "
                    "times (max). Do not call it again in this run; continue with what you have.")
        target = self.target_of(tool, args)
        if target is not None and tool.max_calls_per_target is not None:
            n = self.per_target.get(tool.name, Counter())[target]
            if n >= tool.max_calls_per_target:
                return (f"limit reached: {tool.name} to {target} {n}/{tool.max_calls_per_target} max. "
                        f"Do not call {target} again; tell the user or try another target.")
        return None

    def record(self, tool: Tool, args: dict[str, Any]) -> None:
        self._limits[tool.name] = tool
        self.per_tool[tool.name] += 1
        target = self.target_of(tool, args)
        if target is not None:
            self.per_target.setdefault(tool.name, Counter())[target] += 1

    def lines(self) -> list[str]:
        """'phone_call: 3 (Xfinity 3/3 max)' style, one line per tool called so far."""
        out = []
        for name, n in self.per_tool.items():
            tool = self._limits[name]
            head = f"{name}: {n}" + (f"/{tool.max_calls} max" if tool.max_calls is not None else "")
            targets = self.per_target.get(name)
            if targets:
                cap = f"/{tool.max_calls_per_target} max" if tool.max_calls_per_target is not None else ""
                head += " (" + ", ".join(f"{t} {c}{cap}" for t, c in targets.items()) + ")"
            out.append(head)
        return out
