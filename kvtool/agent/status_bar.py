"""The `<agent_status>` message: facts written by code at the end of the context.

Fields and placements are registries, so adding a field or a strategy is one function.
Placements differ in cache cost: `append` adds a new status each turn (the prefix never
changes, the context grows); `replace` drops the previous status and appends a fresh
one (the prefix cache breaks where the old one was, the context stays small).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Callable

OPEN, CLOSE = "<agent_status>", "</agent_status>"


@dataclass
class StatusSnapshot:
    now: datetime
    elapsed_s: float
    call_lines: list[str] = field(default_factory=list)
    todo_lines: list[str] = field(default_factory=list)
    job_lines: list[str] = field(default_factory=list)
    cwd: str = ""
    os: str = ""
    last_error: str | None = None


FieldFn = Callable[[StatusSnapshot], "list[str] | str | None"]
STATUS_FIELDS: dict[str, FieldFn] = {}


def status_field(name: str) -> Callable[[FieldFn], FieldFn]:
    def register(fn: FieldFn) -> FieldFn:
        STATUS_FIELDS[name] = fn
        return fn

    return register


def _block(title: str, lines: list[str], empty: str) -> list[str] | str:
    return [f"{title}:"] + [f"  {line}" for line in lines] if lines else f"{title}: {empty}"


def format_elapsed(seconds: float) -> str:
    s = int(seconds)
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h {m:02d}m {s:02d}s" if h else f"{m}m {s:02d}s" if m else f"{s}s"


@status_field("time")
def _time(snap: StatusSnapshot) -> str:
    return f"time: {snap.now:%Y-%m-%d %H:%M:%S %Z}".rstrip()


@status_field("elapsed")
def _elapsed(snap: StatusSnapshot) -> str:
    return f"elapsed: {format_elapsed(snap.elapsed_s)}"


@status_field("tool_calls")
def _calls(snap: StatusSnapshot) -> list[str] | str:
    return _block("tool calls", snap.call_lines, "none yet")


@status_field("todo")
def _todo(snap: StatusSnapshot) -> list[str] | str:
    return _block("todo", snap.todo_lines, "empty")


@status_field("jobs")
def _jobs(snap: StatusSnapshot) -> list[str] | None:
    return _block("background jobs", snap.job_lines, "") if snap.job_lines else None


@status_field("cwd")
def _cwd(snap: StatusSnapshot) -> str:
    return f"working directory: {snap.cwd}"


@status_field("os")
def _os(snap: StatusSnapshot) -> str:
    return f"os: {snap.os}"


@status_field("last_error")
def _error(snap: StatusSnapshot) -> str:
    return f"last error: {snap.last_error or 'none'}"


def render_status(snap: StatusSnapshot, fields: list[str] | None = None) -> str:
    lines: list[str] = []
    for name in fields or list(STATUS_FIELDS):
        out = STATUS_FIELDS[name](snap)
        if out:
            lines.extend([out] if isinstance(out, str) else out)
    return "\n".join([OPEN, *lines, CLOSE])


def is_status_message(msg: dict[str, Any]) -> bool:
    return msg.get("role") == "user" and isinstance(msg.get("content"), str) and msg["content"].startswith(OPEN)


Placement = Callable[[list[dict[str, Any]], str], None]
PLACEMENTS: dict[str, Placement] = {}


def placement(name: str) -> Callable[[Placement], Placement]:
    def register(fn: Placement) -> Placement:
        PLACEMENTS[name] = fn
        return fn

    return register


@placement("append")
def _append(messages: list[dict[str, Any]], text: str) -> None:
    messages.append({"role": "user", "content": text})


@placement("replace")
def _replace(messages: list[dict[str, Any]], text: str) -> None:
    for i in range(len(messages) - 1, -1, -1):
        if is_status_message(messages[i]):
            del messages[i]
            break
    messages.append({"role": "user", "content": text})


@placement("off")
def _off(messages: list[dict[str, Any]], text: str) -> None:
    return None
