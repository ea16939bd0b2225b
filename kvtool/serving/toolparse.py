"""Streaming output parser: text deltas -> reasoning, content and tool-call events.

Fed the visible text of each generated token (special tokens skipped; `<think>` and
`<tool_call>` kept, they are not special), it moves `<think>…</think>` to reasoning and
turns each valid call of a declared tool into a ToolCall. Anything that is not a valid call
of a declared tool stays content, verbatim: never dropped, never an error. Text that could
still become a marker is held back until it cannot.

Tool-call formats are a registry (TOOL_FORMATS); Qwen/Hermes `<tool_call>{json}</tool_call>`
is "qwen" (alias "hermes"). Two things small models emit instead count too: a fenced ```json
block, and a bare JSON object opening the answer (Qwen2.5-Coder-0.5B does this), when they
call a declared tool.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Collection

THINK_OPEN, THINK_CLOSE, FENCE = "<think>", "</think>", "```"
CONTENT, REASONING, TOOL, FENCE_INFO, FENCE_JSON, CODE, BARE = (
    "content", "reasoning", "tool", "fence_info", "fence_json", "code", "bare")
STATE_CHANNEL = {CONTENT: "content", CODE: "content", FENCE_INFO: "content", REASONING: "reasoning",
                 TOOL: "tool_call", FENCE_JSON: "tool_call", BARE: "tool_call"}


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text
    id: str = field(default_factory=new_call_id)


@dataclass
class ParseEvent:
    channel: str  # reasoning | content | tool_call
    text: str = ""
    call: ToolCall | None = None


def parse_json_calls(text: str, tools: Collection[str]) -> list[ToolCall] | None:
    """Calls in `text`: JSON objects {"name", "arguments"} (or lists of them) separated by
    whitespace or commas. None unless every object is a call of a declared tool."""
    dec, i, objs = json.JSONDecoder(), 0, []
    while True:
        while i < len(text) and (text[i].isspace() or text[i] == ","):
            i += 1
        if i >= len(text):
            break
        try:
            obj, i = dec.raw_decode(text, i)
        except ValueError:
            return None
        objs.extend(obj if isinstance(obj, list) else [obj])
    calls = []
    for obj in objs:
        if not isinstance(obj, dict):
            return None
        name, args = obj.get("name"), obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(name, str) or name not in tools or not isinstance(args, dict):
            return None
        calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
    return calls or None


@dataclass(frozen=True)
class ToolFormat:
    name: str
    open: str
    close: str

    def parse(self, body: str, tools: Collection[str]) -> list[ToolCall] | None:
        return parse_json_calls(body, tools)

    def prefill(self, name: str | None = None) -> str:
        """Assistant-turn prefix that makes the model call a tool (tool_choice required / named)."""
        if name is None:
            return f'{self.open}\n{{"name": "'
        return f'{self.open}\n{{"name": {json.dumps(name)}, "arguments": '


TOOL_FORMATS: dict[str, ToolFormat] = {}


def register_tool_format(fmt: ToolFormat, *aliases: str) -> ToolFormat:
    for key in (fmt.name, *aliases):
        TOOL_FORMATS[key] = fmt
    return fmt


register_tool_format(ToolFormat("qwen", "<tool_call>", "</tool_call>"), "hermes")
register_tool_format(ToolFormat("none", "", ""))  # no parsing: calls stay in content, as vLLM without a tool parser


def json_end(text: str) -> int:
    """Index just past the JSON object/array that text starts with; -1 while it is unfinished."""
    depth, in_str, escaped = 0, False, False
    for i, ch in enumerate(text):
        if in_str:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return -1


def _partial_suffix(text: str, markers: list[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of a marker."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:n]):
                best = n
                break
    return best


class OutputParser:
    """feed(text) -> events as they become certain; finish() -> the rest."""

    def __init__(self, tools: Collection[str] = (), fmt: ToolFormat | None = None, reasoning: bool = True,
                 in_reasoning: bool = False):
        self.tools = set(tools)
        self.fmt = fmt if self.tools and fmt is not None and fmt.open else None  # no tools or parser: no calls
        self.reasoning = reasoning
        self.state = REASONING if in_reasoning else CONTENT
        self.buf = ""  # text not yet consumed
        self.block = ""  # opening of the current tool/fence block, for the verbatim fallback
        self.calls: list[ToolCall] = []
        self.ws = {"content": "", "reasoning": ""}  # trailing whitespace held per channel
        self.lstrip = in_reasoning  # drop newlines that open a reasoning or post-reasoning segment
        self.at_start = True  # no content yet: a bare JSON call may still open the answer
        self.last = STATE_CHANNEL[self.state]  # channel of the last text consumed (for raw tokens)

    def _markers(self) -> list[str]:
        marks = [THINK_OPEN] if self.reasoning else []
        return marks + ([self.fmt.open, FENCE] if self.fmt else [])

    def feed(self, text: str) -> list[ParseEvent]:
        self.buf += text
        out: list[ParseEvent] = []
        self.last = None
        while self._step(out):
            pass
        if self.last is None:
            self.last = STATE_CHANNEL[self.state]
        return out

    def finish(self) -> list[ParseEvent]:
        out: list[ParseEvent] = []
        buf, self.buf = self.buf, ""
        if self.state == BARE:
            self._emit("content", buf, out)
        elif self.state in (TOOL, FENCE_JSON):  # unclosed block: still a call if its JSON is complete
            self._seal(buf, self.block + buf, out)
        elif self.state == REASONING:
            self._emit("reasoning", buf, out)
            self._emit("reasoning", self.ws["reasoning"], out, hold=False)
        else:
            self._emit("content", (self.block if self.state == FENCE_INFO else "") + buf, out)
        if not self.calls:  # whitespace around tool calls is dropped; otherwise content is verbatim
            self._emit("content", self.ws["content"], out, hold=False)
        self.ws = {"content": "", "reasoning": ""}
        self.state = CONTENT
        return out

    def _emit(self, channel: str, text: str, out: list[ParseEvent], hold: bool = True) -> None:
        if self.lstrip:
            text = text.lstrip("\n")
            self.lstrip = not text
        if not text:
            return
        self.last = "tool_call" if self.state in (TOOL, FENCE_JSON, BARE) else channel
        if channel == "content" and text.strip():
            self.at_start = False
        if hold and not text.strip():
            self.ws[channel] += text
            return
        if hold:
            text, self.ws[channel] = self.ws[channel] + text, ""
            body = text.rstrip()
            text, self.ws[channel] = body, text[len(body):]
        if out and out[-1].channel == channel and out[-1].call is None:
            out[-1].text += text
        else:
            out.append(ParseEvent(channel, text))

    def _seal(self, body: str, raw: str, out: list[ParseEvent]) -> None:
        calls = self.fmt.parse(body, self.tools) if self.fmt else None
        if calls:
            self.calls.extend(calls)
            out.extend(ParseEvent("tool_call", call=c) for c in calls)
        else:
            self._emit("content", raw, out)
        self.last = "tool_call" if calls else "content"

    def _step(self, out: list[ParseEvent]) -> bool:
        """Consume what can be decided now; True if the state changed and another step may help."""
        buf, fmt = self.buf, self.fmt
        if self.state == CONTENT and self.at_start and fmt:
            lead = buf.lstrip()
            if not lead:
                return False
            if lead[0] in "{[":
                self.buf, self.state, self.last = lead, BARE, "tool_call"
                return True
        if self.state == BARE:
            end = json_end(buf)
            self.last = "tool_call"
            if end < 0:
                return False
            calls = parse_json_calls(buf[:end], self.tools)
            if calls:
                self.calls.extend(calls)
                out.extend(ParseEvent("tool_call", call=c) for c in calls)
            else:
                self._emit("content", buf[:end], out)
                self.at_start = False
            self.buf, self.state = buf[end:], CONTENT
            return True
        if self.state == CONTENT:
            marks = self._markers()
            hits = [(i, m) for m in marks if (i := buf.find(m)) >= 0]
            if not hits:
                keep = _partial_suffix(buf, marks)
                self._emit("content", buf[: len(buf) - keep], out)
                self.buf = buf[len(buf) - keep :]
                return False
            i, mark = min(hits)
            self._emit("content", buf[:i], out)
            self.buf = buf[i + len(mark) :]
            if mark == THINK_OPEN:
                self.ws["content"] = ""  # whitespace before <think> is layout
                self.state, self.lstrip, self.last = REASONING, True, "reasoning"
            elif fmt and mark == fmt.open:
                self.state, self.block, self.last = TOOL, mark, "tool_call"
            else:
                self.state, self.block = FENCE_INFO, mark
            return True
        if self.state == REASONING:
            i = buf.find(THINK_CLOSE)
            if i < 0:
                keep = _partial_suffix(buf, [THINK_CLOSE])
                self._emit("reasoning", buf[: len(buf) - keep], out)
                self.buf = buf[len(buf) - keep :]
                return False
            self._emit("reasoning", buf[:i], out)
            self.ws["reasoning"] = ""  # whitespace before </think> is layout, not reasoning
            self.buf, self.state, self.lstrip, self.last = buf[i + len(THINK_CLOSE) :], CONTENT, True, "reasoning"
            return True
        if self.state == TOOL:
            close, again = buf.find(fmt.close), buf.find(fmt.open)
            self.last = "tool_call"
            if close >= 0 and (again < 0 or close < again):
                self.buf, self.state = buf[close + len(fmt.close) :], CONTENT
                self._seal(buf[:close], self.block + buf[: close + len(fmt.close)], out)
                return True
            if again >= 0:  # a new call opened before this one closed: seal what we have
                self.buf = buf[again + len(fmt.open) :]
                self._seal(buf[:again], self.block + buf[:again], out)
                self.block = fmt.open
                return True
            return False
        if self.state == FENCE_INFO:
            nl, inline = buf.find("\n"), buf.find(FENCE)
            if inline >= 0 and (nl < 0 or inline < nl):  # ```code``` on one line
                self._emit("content", self.block + buf[: inline + len(FENCE)], out)
                self.buf, self.state = buf[inline + len(FENCE) :], CONTENT
                return True
            if nl < 0 or nl > 32:  # an info line is short; without one in 32 chars it is code
                if len(buf) <= 32:
                    return False
                self._emit("content", self.block, out)
                self.state = CODE
                return True
            if buf[:nl].strip().lower() in ("json", ""):
                self.block, self.buf, self.state = self.block + buf[: nl + 1], buf[nl + 1 :], FENCE_JSON
            else:
                self._emit("content", self.block + buf[: nl + 1], out)
                self.buf, self.state = buf[nl + 1 :], CODE
            return True
        if self.state == FENCE_JSON:
            lead = buf.lstrip()
            if lead and lead[0] not in "{[":  # not JSON after all: an ordinary code block
                self._emit("content", self.block, out)
                self.state = CODE
                return True
            i = buf.find(FENCE)
            if i < 0:
                self.last = "tool_call"
                return False
            self.buf, self.state = buf[i + len(FENCE) :], CONTENT
            self._seal(buf[:i], self.block + buf[: i + len(FENCE)], out)
            return True
        # CODE: pass through until the closing fence
        i = buf.find(FENCE)
        if i < 0:
            keep = _partial_suffix(buf, [FENCE])
            self._emit("content", buf[: len(buf) - keep], out)
            self.buf = buf[len(buf) - keep :]
            return False
        self._emit("content", buf[: i + len(FENCE)], out)
        self.buf, self.state = buf[i + len(FENCE) :], CONTENT
        return True
