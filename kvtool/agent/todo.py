"""The agent's TODO list, kept by code and shown in the status bar.

The model edits it only through two tools: rewrite the whole list, or change one item's
state. States: pending, in_progress, completed, cancelled.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtool.agent.retry import ToolInputError
from kvtool.agent.tools import Tier, Tool

STATES = ("pending", "in_progress", "completed", "cancelled")
_MARK = {"pending": "[ ]", "in_progress": "[~]", "completed": "[x]", "cancelled": "[-]"}


@dataclass
class TodoItem:
    id: int
    text: str
    status: str = "pending"


class TodoList:
    def __init__(self) -> None:
        self.items: list[TodoItem] = []

    def rewrite(self, items: list) -> str:
        new = []
        for i, item in enumerate(items, 1):
            text, status = (item, "pending") if isinstance(item, str) else (item["text"], item.get("status", "pending"))
            if status not in STATES:
                raise ToolInputError(f"item {i}: status {status!r} is not one of {', '.join(STATES)}")
            new.append(TodoItem(i, text.strip(), status))
        self.items = new
        return f"TODO list now has {len(new)} items:\n" + "\n".join(self.lines())

    def update(self, item_id: int, status: str) -> str:
        item = next((t for t in self.items if t.id == item_id), None)
        if item is None:
            ids = ", ".join(str(t.id) for t in self.items) or "none (use rewrite_todo_list first)"
            raise ToolInputError(f"no TODO item {item_id}; item ids are {ids}")
        item.status = status
        return f"item {item.id} is now {status}: {item.text}"

    def lines(self) -> list[str]:
        return [f"{_MARK[t.status]} {t.id}. {t.text} ({t.status})" for t in self.items]

    def tools(self) -> list[Tool]:
        item_schema = {
            "oneOf": [
                {"type": "string"},
                {
                    "type": "object",
                    "properties": {"text": {"type": "string"}, "status": {"enum": list(STATES)}},
                    "required": ["text"],
                },
            ]
        }

        def rewrite_todo_list(items: list) -> str:
            return self.rewrite(items)

        def update_todo_status(item_id: int, status: str) -> str:
            return self.update(item_id, status)

        return [
            Tool(
                "rewrite_todo_list",
                "Replace the whole TODO list (ids are renumbered from 1).",
                {"type": "object", "properties": {"items": {"type": "array", "items": item_schema}},
                 "required": ["items"]},
                rewrite_todo_list,
                tier=Tier.WRITE,
                concurrent_safe=False,
            ),
            Tool(
                "update_todo_status",
                "Set the status of one TODO item.",
                {"type": "object",
                 "properties": {"item_id": {"type": "integer"}, "status": {"enum": list(STATES)}},
                 "required": ["item_id", "status"]},
                update_todo_status,
                tier=Tier.WRITE,
                concurrent_safe=False,
            ),
        ]
