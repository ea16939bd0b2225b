"""JSON schema mode (response_format json_schema): the JSON check of json_mode, narrowed by a schema.

What a schema constrains, character by character: each value's type (`type`, a name or a list of
names; `enum` and `const` of strings), an object's keys (`properties`; with `additionalProperties`
absent or false no other key, a key at most once, `required` ones before the `}`), an array's items
(`items`, `minItems`, `maxItems`), a string's length (`minLength`, `maxLength`, in characters; one split
across tokens, which each decode to U+FFFD, is not counted), integers (no fraction or exponent; `minimum`,
`maximum`, `exclusiveMinimum`, `exclusiveMaximum`: each digit must leave some integer in range, and the
number may end only in range). Ignored, as documentation: title, description, format, default, examples,
the bounds of non-integer numbers, multipleOf and pattern. Refused with an error
naming them: combinators and references (anyOf, oneOf, allOf, not, $ref, if/then/else, ...), and
enums that are not strings. Keys and enum strings take no escapes.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from kvtool.engine.json_mode import (AFTER, ARRAY_FIRST, COLON, ESCAPE, KEY, KEY_OR_END, NUMBER, NUMBER_PREFIX,
                                     START, STRING, UNICODE, VALUE, WS, JsonState, feed)
from kvtool.errors import InvalidParameterError

TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
FIRST = {"object": "{", "array": "[", "string": '"', "number": "-0123456789", "integer": "-0123456789",
         "boolean": "tf", "null": "n"}
BOUNDS = ("minLength", "maxLength", "minItems", "maxItems")
RANGE = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
UNSUPPORTED = ("anyOf", "oneOf", "allOf", "not", "$ref", "$defs", "definitions", "if", "then", "else",
               "patternProperties", "prefixItems", "dependentSchemas", "unevaluatedProperties")


def check_schema(node, where: str = "schema") -> None:
    """InvalidParameterError naming the first part of the schema this mode cannot enforce."""
    if not isinstance(node, dict):
        raise InvalidParameterError(f"json_schema: {where} must be an object, got {type(node).__name__}")
    bad = [k for k in UNSUPPORTED if k in node]
    if bad:
        raise InvalidParameterError(f"json_schema: {where} uses {', '.join(bad)}, which JSON schema mode does not "
                                    "support (type, properties, required, additionalProperties, items, enum, const, "
                                    "minLength, maxLength, minItems, maxItems)")
    types = node.get("type", [])
    for t in [types] if isinstance(types, str) else types:
        if t not in TYPES:
            raise InvalidParameterError(f"json_schema: {where} has unknown type {t!r}; use one of {', '.join(TYPES)}")
    values = node["enum"] if "enum" in node else [node["const"]] if "const" in node else []
    if any(not isinstance(v, str) or "\\" in v or '"' in v for v in values):
        raise InvalidParameterError(f"json_schema: {where} has an enum or const that is not plain strings; "
                                    "JSON schema mode enforces string enums only")
    for low, high in (BOUNDS[:2], BOUNDS[2:]):
        for name in (low, high):
            if name in node and (not isinstance(node[name], int) or isinstance(node[name], bool) or node[name] < 0):
                raise InvalidParameterError(f"json_schema: {where}.{name} must be an integer >= 0")
        if node.get(low, 0) > node.get(high, node.get(low, 0)):
            raise InvalidParameterError(f"json_schema: {where} has {low} {node[low]} > {high} {node[high]}")
    for name in RANGE:
        if name in node and (isinstance(node[name], bool) or not isinstance(node[name], (int, float))
                             or not math.isfinite(node[name])):
            raise InvalidParameterError(f"json_schema: {where}.{name} must be a number")
    lo, hi = _int_range(node)
    if _types(node) == {"integer"} and lo is not None and hi is not None and lo > hi:
        raise InvalidParameterError(f"json_schema: {where} leaves no integer between its bounds")
    keys, _ = _keys(node)
    missing = [k for k in node.get("required", []) if keys is not None and k not in keys]
    if missing:
        raise InvalidParameterError(f"json_schema: {where} requires {missing}, which its properties do not allow "
                                    "(no object could have them)")
    for key, sub in (node.get("properties") or {}).items():
        check_schema(sub, f"{where}.properties.{key}")
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            check_schema(node[key], f"{where}.{key}")
    if types and "object" not in ([types] if isinstance(types, str) else types) and where == "schema":
        raise InvalidParameterError("json_schema: the schema's root must be an object (type: object)")


def _types(node: dict | None) -> set[str]:
    if not node:
        return set(TYPES)
    if "enum" in node or "const" in node:
        return {"string"}
    types = node.get("type")
    if types is None:
        return {"object"} if "properties" in node else {"array"} if "items" in node else set(TYPES)
    return {types} if isinstance(types, str) else set(types)


def _strings(node: dict | None) -> list[str] | None:
    """The values a string may take, or None for any."""
    if not node:
        return None
    return node["enum"] if "enum" in node else [node["const"]] if "const" in node else None


def _keys(node: dict) -> tuple[set[str] | None, dict | None]:
    """(keys an object may have, or None for any; the schema of keys beyond `properties`)."""
    props, extra = node.get("properties"), node.get("additionalProperties")
    if isinstance(extra, dict):
        return None, extra
    if extra is True or (props is None and extra is None):
        return None, None
    return set(props or ()), None


class Frame(NamedTuple):
    node: dict | None  # the open object's or array's schema
    seen: frozenset = frozenset()  # an object's keys so far
    key: str = ""  # the key whose value is being read
    items: int = 0  # an array's items so far (the one being read included)


class SchemaState(NamedTuple):
    json: JsonState
    frames: tuple = ()
    expect: dict | None = None  # schema of the value being started or read (None: anything)
    text: str = ""  # a key's or an enum string's characters so far
    count: int = 0  # a value string's characters so far (an escape counts once)

    @property
    def done(self) -> bool:
        return self.json.done


def start(schema: dict) -> SchemaState:
    return SchemaState(JsonState(), (), schema)


def _allowed_keys(frame: Frame) -> set[str] | None:
    keys, _ = _keys(frame.node or {})
    return None if keys is None else keys - frame.seen


def _may_close(frame: Frame) -> bool:
    return set((frame.node or {}).get("required", [])) <= frame.seen


def _value_schema(frame: Frame, container: str) -> dict | None:
    node = frame.node or {}
    if container == "a":
        return node.get("items")
    return (node.get("properties") or {}).get(frame.key, _keys(node)[1])


def _int_range(node: dict | None) -> tuple[int | None, int | None]:
    """The integers an integer value may take: (lowest, highest), None where unbounded."""
    node = node or {}
    lows = [math.ceil(node["minimum"])] if "minimum" in node else []
    lows += [math.floor(node["exclusiveMinimum"]) + 1] if "exclusiveMinimum" in node else []
    highs = [math.floor(node["maximum"])] if "maximum" in node else []
    highs += [math.ceil(node["exclusiveMaximum"]) - 1] if "exclusiveMaximum" in node else []
    return (max(lows) if lows else None), (min(highs) if highs else None)


def _in(value: int, lo: int | None, hi: int | None) -> bool:
    return (lo is None or value >= lo) and (hi is None or value <= hi)


def _int_prefix_ok(text: str, lo: int | None, hi: int | None) -> bool:
    """Whether some JSON integer whose text starts with `text` (a sign, digits) lies in [lo, hi]."""
    digits = text.lstrip("-")
    if text.startswith("-"):  # its magnitude m = -value lies in [-hi, -lo]
        lo, hi = (None if hi is None else -hi), (None if lo is None else -lo)
    if not digits:  # any magnitude >= 0
        return hi is None or hi >= 0
    if digits == "0":
        return _in(0, lo, hi)
    d, scale = int(digits), 1
    while hi is None or d * scale <= hi:  # the magnitudes d, d0..d9, d00..d99, ...
        if lo is None or (d + 1) * scale - 1 >= lo:
            return True
        scale *= 10
    return False


def _bound(node: dict | None, name: str) -> int | None:
    return (node or {}).get(name)


def _tracked(js: JsonState, frames: tuple, expect) -> bool:
    """Whether the string being read must match a list (a restricted key, an enum value)."""
    if js.part == "k":
        return _allowed_keys(frames[-1]) is not None
    return _strings(expect) is not None


def schema_feed(state: SchemaState, ch: str) -> SchemaState | None:
    js, frames, expect, text, _ = state
    mode = js.mode
    if mode == NUMBER and not NUMBER_PREFIX.fullmatch(js.part + ch):
        mode = AFTER  # ch ends the number and is read as what follows it
    elif mode == NUMBER and ch in ".eE" and _types(expect) == {"integer"}:
        return None
    in_array = js.stack[-1:] == "a"
    if mode in (START, VALUE) or (mode == ARRAY_FIRST and ch != "]"):
        if ch not in WS and not any(ch in FIRST[t] for t in _types(expect)):
            return None
        if mode == ARRAY_FIRST and ch not in WS and _bound(frames[-1].node, "maxItems") == 0:
            return None
    elif mode == STRING and _tracked(js, frames, expect):
        values = _allowed_keys(frames[-1]) if js.part == "k" else _strings(expect)
        if ch == "\\" or (ch == '"' and text not in values):
            return None
        if ch != '"' and not any(v.startswith(text + ch) for v in values):
            return None
    elif mode == STRING and js.part == "v":  # a free value string: its length bounds
        if ch == '"' and state.count < (_bound(expect, "minLength") or 0):
            return None
        high = _bound(expect, "maxLength")
        if ch != '"' and high is not None and state.count >= high:
            return None
    elif in_array and mode in (ARRAY_FIRST, AFTER) and ch in ",]":
        items, node = frames[-1].items, frames[-1].node
        if ch == "]" and items < (_bound(node, "minItems") or 0):
            return None
        if ch == "," and _bound(node, "maxItems") is not None and items >= _bound(node, "maxItems"):
            return None
    elif mode in (KEY_OR_END, AFTER) and js.stack[-1:] == "o":
        if ch == "}" and not _may_close(frames[-1]):
            return None
        allowed = _allowed_keys(frames[-1])
        if ch in ',"' and allowed is not None and not allowed:
            return None  # no key is left to write
    nxt = feed(js, ch)
    if nxt is None:
        return None
    if in_array and ((mode == ARRAY_FIRST and ch not in WS + "]") or (mode == AFTER and ch == ",")):
        frames = frames[:-1] + (frames[-1]._replace(items=frames[-1].items + 1),)  # an item starts
    if _types(expect) == {"integer"} and (js.mode == NUMBER or nxt.mode == NUMBER):
        lo, hi = _int_range(expect)
        if nxt.mode == NUMBER and not _int_prefix_ok(nxt.part, lo, hi):
            return None
        if js.mode == NUMBER and nxt.mode != NUMBER and not _in(int(js.part), lo, hi):
            return None  # the number would end out of range
    out = _follow(js, nxt, frames, expect, text, ch)
    if out.json.mode in (STRING, ESCAPE, UNICODE) and out.json.part[:1] == "v":
        inside = js.mode in (STRING, ESCAPE, UNICODE)
        out = out._replace(count=state.count + (js.mode == STRING) if inside else 0)
    return out


def _follow(js: JsonState, nxt: JsonState, frames: tuple, expect, text: str, ch: str) -> SchemaState:
    """The schema side of the JSON transition js -> nxt on ch."""
    if len(nxt.stack) > len(js.stack):  # a container opened: it is the value `expect` describes
        frames = frames + (Frame(expect),)
        return SchemaState(nxt, frames, _value_schema(frames[-1], "a") if nxt.stack[-1] == "a" else None)
    if len(nxt.stack) < len(js.stack):  # a container closed (the root too: DONE has an empty stack)
        return SchemaState(nxt, frames[:-1])
    if js.mode == STRING and nxt.mode == COLON:  # a key ended
        f = frames[-1]
        return SchemaState(nxt, frames[:-1] + (Frame(f.node, f.seen | {text}, text),))
    if nxt.mode == VALUE:  # after a key's colon, or an array's comma
        return SchemaState(nxt, frames, _value_schema(frames[-1], nxt.stack[-1]))
    if nxt.mode == STRING:
        if js.mode not in (STRING, ESCAPE, UNICODE):
            return SchemaState(nxt, frames, expect, "")  # a string starts
        grow = js.mode == STRING and (nxt.part == "k" or _strings(expect) is not None)
        return SchemaState(nxt, frames, expect, text + ch if grow else text)
    if nxt.mode in (AFTER, KEY, COLON):
        return SchemaState(nxt, frames)
    return SchemaState(nxt, frames, expect, text)  # inside a number, a literal or an escape


def schema_advance(state: SchemaState, text: str) -> SchemaState | None:
    for ch in text:
        js = state.json
        if ch == "\ufffd" and js.mode in (STRING, ESCAPE, UNICODE) and not _tracked(js, state.frames, state.expect):
            continue  # part of a multi-byte character in a free string
        state = schema_feed(state, ch)
        if state is None:
            return None
    return state
