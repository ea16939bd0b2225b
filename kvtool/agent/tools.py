"""Tool declarations: what the model sees (name, description, JSON schema) and what the
dispatcher enforces (permission tier, timeout, retries, concurrency, call limits)."""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable

from kvtool.agent.retry import RetryPolicy
from kvtool.config import is_whole
from kvtool.errors import KvtoolError

TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


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
        check_declaration(self)
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


def check_declaration(tool: Tool) -> None:
    """What an OpenAI-compatible server takes as a function tool, and what the dispatcher needs to call it."""
    import jsonschema

    def bad(why: str) -> None:
        raise KvtoolError(f"tool {tool.name!r}: {why}")

    if not isinstance(tool.name, str) or not TOOL_NAME.fullmatch(tool.name):
        bad("the name must be 1-64 letters, digits, '_', '-' or '.' (what OpenAI-compatible servers accept)")
    if not isinstance(tool.description, str):
        bad(f"the description must be a string, got {type(tool.description).__name__}")
    if not isinstance(tool.parameters, dict) or tool.parameters.get("type", "object") != "object":
        bad("parameters must be a JSON Schema object: {'type': 'object', 'properties': {...}}")
    try:
        jsonschema.validators.validator_for(tool.parameters, default=jsonschema.Draft202012Validator) \
            .check_schema(tool.parameters)
    except jsonschema.SchemaError as exc:
        bad(f"parameters is not a valid JSON Schema: {exc.message} (at {'/'.join(map(str, exc.path)) or 'the top'})")
    if not callable(tool.func):
        bad(f"func must be callable (a function, async function or callable object), got {type(tool.func).__name__}")
    if tool.timeout_s is not None and (isinstance(tool.timeout_s, bool) or not isinstance(tool.timeout_s, (int, float))
                                       or not 0 < tool.timeout_s < float("inf")):
        bad(f"timeout_s must be a finite number of seconds > 0 or None, got {tool.timeout_s!r}")
    for name in ("max_calls", "max_calls_per_target"):
        value = getattr(tool, name)
        if value is not None and not is_whole(value, 1):
            bad(f"{name} must be an integer >= 1 or None, got {value!r}")


class ToolRegistry:
    """Tools in registration order; the order is kept stable because re-ordered tool
    definitions change the prompt prefix and cost the whole prefix cache."""

    def __init__(self, tools: list[Tool] | None = None):
        self._tools: dict[str, Tool] = {}
        for t in tools or []:
            self.add(t)

    def add(self, tool: Tool) -> Tool:
        if not isinstance(tool, Tool):
            raise KvtoolError(f"a ToolRegistry holds Tool objects; got {type(tool).__name__} {tool!r:.60}")
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
