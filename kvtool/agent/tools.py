"""Tool declarations: what the model sees (name, description, JSON schema) and what the
dispatcher enforces (permission tier, timeout, retries, concurrency, call limits)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable

from kvtool.agent.retry import RetryPolicy
from kvtool.errors import KvtoolError


class Tier(str, Enum):
    READ_ONLY = "read_only"  # runs automatically
    WRITE = "write"  # runs automatically, logged to the audit trail
    DESTRUCTIVE = "destructive"  # needs the confirm callback; denied when non-interactive
    EXTERNAL = "external"  # acts outside this machine: same rule as destructive

    @property
    def needs_confirmation(self) -> bool:
        return self in (Tier.DESTRUCTIVE, Tier.EXTERNAL)


@dataclass
class ToolContext:
    """Handed to tools whose function takes a `ctx` parameter."""

    call_id: str
    tool_name: str
    progress: Callable[[float, str], None] = lambda fraction, note="": None


@dataclass
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]
    func: Callable[..., Any]  # sync or async; called with the validated arguments
    tier: Tier = Tier.READ_ONLY
    timeout_s: float | None = None  # None: AgentConfig.tool_timeout_s
    retry: RetryPolicy | None = None  # None: AgentConfig.retry
    concurrent_safe: bool = True  # False: runs alone, after earlier calls of the turn
    background: bool = False  # True: returns a task id at once, completion arrives as an event
    max_calls: int | None = None  # per run, across all targets
    target_arg: str | None = None  # argument that names who/what the call is aimed at
    max_calls_per_target: int | None = None
    takes_context: bool = field(init=False, default=False)
    is_async: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self.tier = Tier(self.tier)
        self.takes_context = "ctx" in inspect.signature(self.func).parameters
        # callable objects count too: their async-ness is on __call__
        self.is_async = inspect.iscoroutinefunction(self.func) or inspect.iscoroutinefunction(
            getattr(self.func, "__call__", None))

    def openai_schema(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


class ToolRegistry:
    """Tools in registration order; the order is kept stable because re-ordered tool
    definitions change the prompt prefix and cost the whole prefix cache."""

    def __init__(self, tools: list[Tool] | None = None):
        self._tools: dict[str, Tool] = {}
        for t in tools or []:
            self.add(t)

    def add(self, tool: Tool) -> Tool:
        if tool.name in self._tools:
            raise KvtoolError(f"tool {tool.name!r} is registered twice; tool names must be unique")
        self._tools[tool.name] = tool
        return tool

    def tool(self, name: str | None = None, description: str = "", parameters: dict | None = None, **opts: Any):
        """Decorator form of add(); the description defaults to the docstring."""

        def wrap(func: Callable[..., Any]) -> Callable[..., Any]:
            self.add(
                Tool(
                    name=name or func.__name__,
                    description=description or inspect.getdoc(func) or "",
                    parameters=parameters or {"type": "object", "properties": {}},
                    func=func,
                    **opts,
                )
            )
            return func

        return wrap

    def extend(self, tools: list[Tool]) -> None:
        for t in tools:
            self.add(t)

    def get(self, name: str) -> Tool | None:
        return self._tools.get(name)

    def names(self) -> list[str]:
        return list(self._tools)

    def __contains__(self, name: str) -> bool:
        return name in self._tools

    def __iter__(self):
        return iter(self._tools.values())

    def openai_schemas(self) -> list[dict[str, Any]]:
        return [t.openai_schema() for t in self._tools.values()]
