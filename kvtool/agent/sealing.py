"""Assemble streamed tool-call fragments and decide when each call is sealed.

A sealed call will not change any more, so it can be dispatched while the model keeps
generating. Over HTTP a call is sealed when a later index starts, when finish_reason
arrives, or when its arguments already parse as a JSON object; a backend that knows
better (in-process: `</tool_call>`) seals explicitly via `StreamDelta.sealed`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from kvtool.agent.backend import StreamDelta


@dataclass
class SealedCall:
    index: int
    id: str
    name: str
    arguments: str  # raw text the model produced; parsing and validation happen at dispatch
    sealed_at: float = field(default_factory=time.perf_counter)

    def as_message_call(self) -> dict:
        """The OpenAI `tool_calls` entry; malformed arguments become {} so the history
        stays renderable (the tool result quotes what was wrong)."""
        try:
            ok = isinstance(json.loads(self.arguments or "{}"), dict)
        except json.JSONDecodeError:
            ok = False
        args = (self.arguments or "{}") if ok else "{}"
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": args}}


@dataclass
class _Open:
    id: str | None = None
    name: str = ""
    arguments: str = ""


def _is_json_object(text: str) -> bool:
    if not text.rstrip().endswith("}"):  # cheap pre-check: most fragments end elsewhere
        return False
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


class CallAssembler:
    def __init__(self, id_prefix: str = "call", taken: set[str] | None = None):
        self._taken = taken if taken is not None else set()  # ids used earlier in the conversation
        self._open: dict[int, _Open] = {}
        self._sealed: dict[int, SealedCall] = {}
        self._late: dict[int, str] = {}  # text that arrived after a call was sealed
        self._id_prefix = id_prefix

    def feed(self, delta: StreamDelta) -> list[SealedCall]:
        """Absorb one delta; return the calls it sealed, in index order."""
        ready: set[int] = set()
        for frag in delta.tool_calls:
            if frag.index in self._sealed:
                self._late[frag.index] = self._late.get(frag.index, "") + frag.arguments
                continue
            if frag.index not in self._open:
                ready.update(i for i in self._open if i < frag.index)
            call = self._open.setdefault(frag.index, _Open())
            call.id = call.id or frag.id
            call.name += frag.name or ""
            call.arguments += frag.arguments
            if _is_json_object(call.arguments):
                ready.add(frag.index)
        ready.update(i for i in delta.sealed if i in self._open)
        if delta.finish_reason is not None:
            ready.update(self._open)
        return [self._seal(i) for i in sorted(ready)]

    def finish(self) -> list[SealedCall]:
        """Seal whatever is still open (a stream that ended without finish_reason)."""
        return [self._seal(i) for i in sorted(self._open)]

    def _seal(self, index: int) -> SealedCall:
        call = self._open.pop(index)
        call_id = base = call.id or f"{self._id_prefix}_{index}"
        n = 1
        while call_id in self._taken:  # some servers repeat ids across turns; tool messages need unique ones
            n += 1
            call_id = f"{base}_{n}"
        self._taken.add(call_id)
        sealed = SealedCall(
            index=index,
            id=call_id,
            name=call.name.strip(),
            arguments=call.arguments,
        )
        self._sealed[index] = sealed
        return sealed

    @property
    def unsealed(self) -> list[int]:
        return sorted(self._open)

    @property
    def late_fragments(self) -> dict[int, str]:
        """Non-empty when a server kept streaming arguments after the JSON was complete."""
        return {i: t for i, t in self._late.items() if t.strip()}
