"""Checks that a message list is one an OpenAI-compatible server will accept."""

from __future__ import annotations

import json
from typing import Any


def message_problems(messages: list[dict[str, Any]]) -> list[str]:
    """Every assistant tool call is answered by the tool messages right after it, in call
    order; no tool message is orphaned; ids are unique; arguments are JSON objects."""
    problems: list[str] = []
    seen_ids: set[str] = set()
    i = 0
    while i < len(messages):
        msg = messages[i]
        role = msg.get("role")
        if role == "assistant":
            calls = msg.get("tool_calls") or []
            if not calls and not msg.get("content"):
                problems.append(f"message {i}: assistant message with neither content nor tool calls")
            for j, call in enumerate(calls):
                cid = call.get("id")
                if not cid or cid in seen_ids:
                    problems.append(f"message {i}: tool call {j} has a missing or repeated id {cid!r}")
                seen_ids.add(cid)
                try:
                    if not isinstance(json.loads(call["function"]["arguments"]), dict):
                        raise ValueError
                except (ValueError, KeyError, TypeError):
                    problems.append(f"message {i}: tool call {cid} arguments are not a JSON object")
                answer = messages[i + 1 + j] if i + 1 + j < len(messages) else None
                if answer is None or answer.get("role") != "tool" or answer.get("tool_call_id") != cid:
                    problems.append(f"message {i}: tool call {cid} is not answered by message {i + 1 + j}")
            i += 1 + len(calls)
            continue
        if role == "tool":
            problems.append(f"message {i}: tool message {msg.get('tool_call_id')!r} does not follow its call")
        elif role not in ("system", "user"):
            problems.append(f"message {i}: unknown role {role!r}")
        i += 1
    return problems


def check_messages(messages: list[dict[str, Any]]) -> None:
    problems = message_problems(messages)
    if problems:
        raise ValueError("invalid message list:\n" + "\n".join(problems))
