"""The JSON grammar state: an incremental syntax check of one JSON object, character by character.

JsonState is an immutable tuple so trying a token costs one small copy: (mode, stack of open
containers, pending literal or number part, whitespace run). No more than MAX_WS whitespace characters
in a row and no number longer than MAX_NUMBER characters are allowed, so a small model cannot stall in
a run of newlines or of digits. kvtool.structured.json_schema follows a schema on top of this state, and
kvtool.structured.json_mode turns either into a per-token constraint.
"""

from __future__ import annotations

import re
from typing import NamedTuple

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
