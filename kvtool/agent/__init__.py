"""kvtool.agent: an agent loop that dispatches each tool call the moment it is sealed.

Names are imported lazily so `kvtool --help` (which imports the CLI module) stays fast.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Agent": "loop", "AgentResult": "loop", "AgentConfig": "config",
    "Tool": "tools", "ToolRegistry": "tools", "ToolContext": "tools", "Tier": "tools",
    "ChatBackend": "backend", "StreamDelta": "backend", "ToolCallFragment": "backend", "Usage": "backend",
    "BackendError": "backend", "BackendUnavailable": "backend",
    "OpenAIHTTPBackend": "http_backend", "ScriptedBackend": "demos.scripted", "FakeEndpoint": "demos.fake_endpoint",
    "reply": "demos.script", "http_error": "demos.script", "Reply": "demos.script",
    "RetryPolicy": "retry", "ToolError": "retry", "ToolInputError": "retry", "RetryableToolError": "retry",
    "RateLimited": "retry",
    "Event": "events", "user_message": "events", "Observer": "observer", "TerminalObserver": "render",
    "check_messages": "trajectory", "message_problems": "trajectory",
    "skill_tool": "skills", "make_demo_tools": "demos.tools", "run_demo": "demos.runner", "DEMOS": "demos.scenarios",
    "run_tool_eval": "demos.evaluate", "run_status_bar_cache_eval": "demos.evaluate",
    "evaluate_tool_use": "demos.evaluate", "status_bar_cache_rates": "demos.evaluate",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'kvtool.agent' has no attribute {name!r}")
    return getattr(importlib.import_module(f"kvtool.agent.{_EXPORTS[name]}"), name)
