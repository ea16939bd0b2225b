"""JSON mode (response_format json_object, json_schema): every sampled token keeps the output a prefix of one
JSON object (of the schema's shape, with kvtool.engine.json_schema).

JsonState is an incremental JSON syntax check over characters, an immutable tuple so trying a token
costs one small copy: (mode, stack of open containers, pending literal or number part, whitespace
run). JsonConstraint checks candidate tokens by their text pieces, most likely first, and ends the
output with an end-of-turn token once the object is closed. A piece that decodes alone to U+FFFD
(part of a multi-byte character) is allowed inside strings only. Special tokens other than the
end of turn are never allowed; neither are more than MAX_WS whitespace characters in a row, nor
numbers longer than MAX_NUMBER characters, so a small model cannot stall in a run of newlines or
of digits.
"""

from __future__ import annotations

import re
from typing import Iterable, NamedTuple

MAX_WS = 16
MAX_NUMBER = 32  # characters: room for any 64-bit integer or double, written out
WS = " \t\n\r"
ESCAPES = set('"\\/bfnrtu')
LITERALS = {"t": "rue", "f": "alse", "n": "ull"}

# modes
START, VALUE, KEY_OR_END, KEY, COLON, AFTER, ARRAY_FIRST, STRING, ESCAPE, UNICODE, NUMBER, LITERAL, DONE = range(13)


class JsonState(NamedTuple):
    mode: int = START
    stack: str = ""  # "o" object, "a" array; the innermost last
    part: str = ""  # STRING: "k" for a key, "v" for a value; UNICODE: hex digits left; NUMBER: text; LITERAL: rest
    ws: int = 0

    @property
    def done(self) -> bool:
        return self.mode == DONE


def _after_value(stack: str) -> JsonState:
    return JsonState(AFTER, stack) if stack else JsonState(DONE)


NUMBER_PREFIX = re.compile(r"-?(?:(?:0|[1-9]\d*)(?:\.\d+(?:[eE][+-]?\d*)?|\.|[eE][+-]?\d*)?)?")
NUMBER_WHOLE = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")


def _value_start(ch: str, stack: str) -> JsonState | None:
    if ch == "{":
        return JsonState(KEY_OR_END, stack + "o")
    if ch == "[":
        return JsonState(ARRAY_FIRST, stack + "a")
    if ch == '"':
        return JsonState(STRING, stack, "v")
    if ch in LITERALS:
        return JsonState(LITERAL, stack, LITERALS[ch])
    if ch == "-" or ch.isdigit():
        return JsonState(NUMBER, stack, ch)
    return None


def feed(state: JsonState, ch: str) -> JsonState | None:
    """The state after one more character, or None if no JSON object starts with the text so far plus ch."""
    mode, stack, part, ws = state
    if mode == STRING:
        if ch == '"':
            return JsonState(COLON, stack) if part == "k" else _after_value(stack)
        if ch == "\\":
            return JsonState(ESCAPE, stack, part)
        return state if ch >= " " else None  # control characters must be escaped
    if mode == ESCAPE:
        if ch not in ESCAPES:
            return None
        return JsonState(UNICODE, stack, part + "4") if ch == "u" else JsonState(STRING, stack, part)
    if mode == UNICODE:  # part: "k"/"v" then the hex digits still expected
        if ch not in "0123456789abcdefABCDEF":
            return None
        left = int(part[1:]) - 1
        return JsonState(UNICODE, stack, part[0] + str(left)) if left else JsonState(STRING, stack, part[0])
    if mode == LITERAL:
        if ch != part[0]:
            return None
        return JsonState(LITERAL, stack, part[1:]) if len(part) > 1 else _after_value(stack)
    if mode == NUMBER:
        if NUMBER_PREFIX.fullmatch(part + ch):
            return JsonState(NUMBER, stack, part + ch) if len(part) < MAX_NUMBER else None
        if not NUMBER_WHOLE.fullmatch(part):
            return None
        return feed(_after_value(stack), ch)  # the number ended; ch belongs to what follows
    if ch in WS:
        if mode == DONE or ws >= MAX_WS:
            return None
        return JsonState(mode, stack, part, ws + 1)
    if mode == START:
        return JsonState(KEY_OR_END, "o") if ch == "{" else None  # json_object: the value is an object
    if mode in (VALUE, ARRAY_FIRST):
        if mode == ARRAY_FIRST and ch == "]":
            return _after_value(stack[:-1])
        return _value_start(ch, stack)
    if mode in (KEY_OR_END, KEY):
        if ch == '"':
            return JsonState(STRING, stack, "k")
        return _after_value(stack[:-1]) if mode == KEY_OR_END and ch == "}" else None
    if mode == COLON:
        return JsonState(VALUE, stack) if ch == ":" else None
    if mode == AFTER:
        top = stack[-1]
        if ch == ",":
            return JsonState(KEY, stack) if top == "o" else JsonState(VALUE, stack)
        if ch == ("}" if top == "o" else "]"):
            return _after_value(stack[:-1])
        return None
    return None  # DONE: nothing may follow the object but the end of the turn


def advance(state: JsonState, text: str) -> JsonState | None:
    for ch in text:
        if state.mode in (STRING, ESCAPE, UNICODE) and ch == "\ufffd":
            continue  # part of a multi-byte character: fine inside a string
        state = feed(state, ch)
        if state is None:
            return None
    return state


class JsonConstraint:
    """Per request: which token may come next so the output stays a prefix of one JSON object."""

    def __init__(self, pieces: list[str], special_ids: Iterable[int], stop_ids: Iterable[int], schema: dict | None = None,
                 suffix: str = ""):
        """schema: a JSON schema the object must also follow (kvtool.engine.json_schema); None: any object.
        suffix: text that must follow the object before the turn ends (a tool call's closing tag)."""
        self.pieces, self.special, self.stops = pieces, set(special_ids), set(stop_ids)
        self.suffix = suffix  # what of it is still to come, once the object is closed
        if not self.stops:
            raise ValueError("JSON mode needs an end-of-turn token to end the object after it closes; this model "
                             "and request have none (give stop_token_ids)")
        if schema is None:
            self.state, self._advance = JsonState(), advance
        else:
            from kvtool.engine.json_schema import schema_advance, start

            self.state, self._advance = start(schema), schema_advance

    @property
    def finished(self) -> bool:
        """The object and its suffix are out: only the end of the turn may follow."""
        return self.state.done and not self.suffix

    def next_state(self, token: int) -> JsonState | None:
        """The state after token, or None when it is not allowed now."""
        if token in self.stops:
            return self.state if self.finished else None
        if token >= len(self.pieces) or self.finished:
            return None
        piece = self.pieces[token]
        if self.state.done:  # spelling the suffix: any piece that is a start of what is left
            return self.state if piece and self.suffix.startswith(piece) else None
        if token in self.special:
            return None
        return self._advance(self.state, piece) if piece else None

    def accept(self, token: int) -> None:
        state = self.next_state(token)
        if state is None:
            raise ValueError(f"token {token} ({self.pieces[token]!r}) does not continue the JSON output")
        if self.state.done and token not in self.stops:
            self.suffix = self.suffix[len(self.pieces[token]):]
        self.state = state
