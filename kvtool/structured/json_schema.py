"""JSON schema mode (response_format json_schema): the JSON check of json_mode, narrowed by a schema.

What a schema constrains, character by character: each value's type (`type`, a name or a list of
names; `enum` and `const` of strings, integers, booleans and null), an object's keys (`properties`; with
`additionalProperties` absent or false no other key, a key at most once, `required` ones before the `}`),
how many keys it has (`minProperties`, `maxProperties`), an array's items (`prefixItems` for the leading
ones, `items` for the rest, `minItems`, `maxItems`), a string's length (`minLength`, `maxLength`, in
characters; one split across tokens, which each decode to U+FFFD, is not counted). Integers take no fraction or exponent; their bounds, number bounds, `pattern`
and `format` are checked by kvtool.structured.schema_values. `$ref`, `allOf`, `anyOf` and `oneOf` are
followed as kvtool.structured.schema_refs describes: the state is then one SchemaState per alternative the
text still fits (SchemaBranches). Ignored, as documentation: title, description, default, examples,
formats schema_values does not know, and multipleOf. Refused with an error naming them: not,
if/then/else, patternProperties and the like. Keys and enum strings take no escapes. check_schema()
first checks that each keyword the compiler reads has the right JSON type, naming its path (the old
list form of `items` is refused: prefixItems says the same).
"""

from __future__ import annotations

import json
import math
from typing import NamedTuple

from kvtool.errors import InvalidParameterError
from kvtool.structured.json_syntax import (AFTER, ARRAY_FIRST, COLON, ESCAPE, KEY, KEY_OR_END, NUMBER, NUMBER_PREFIX,
                                           START, STRING, UNICODE, VALUE, WS, JsonState, feed)
from kvtool.structured.schema_refs import ALL as TYPES
from kvtool.structured.schema_refs import branches, prepare
from kvtool.structured.schema_refs import types_of as _types
from kvtool.structured.schema_values import (RANGE, check_pattern, empty_range, has_range, int_ok, int_range, number_ok,
                                             patterns, string_ok)

FIRST = {"object": "{", "array": "[", "string": '"', "number": "-0123456789", "integer": "-0123456789",
         "boolean": "tf", "null": "n"}
BOUNDS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
UNSUPPORTED = ("not", "if", "then", "else", "patternProperties", "dependentSchemas",
               "unevaluatedProperties", "dependentRequired")
SUBSCHEMAS = ("properties", "$defs", "definitions")  # objects of named schemas
SCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")
MAX_BRANCHES = 64  # anyOf alternatives followed side by side; past this the first ones are kept


def check_schema(schema, where: str = "schema") -> None:
    """InvalidParameterError naming the first part of the schema this mode cannot enforce."""
    _check_keywords(schema, where, set())
    root = prepare(schema)
    if not any("object" in _types(b) for b in branches(root)):
        raise InvalidParameterError("json_schema: the schema's root must be an object (type: object)")
    _check(root, where, set())


def _got(value) -> str:
    text = json.dumps(value, default=repr)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_keywords(node, where: str, seen: set[int]) -> None:
    """The JSON type of each keyword the compiler reads, in node and the schemas inside it, as written."""
    def bad(key: str, what: str):
        return InvalidParameterError(f"json_schema: {where}.{key} must be {what}, got {_got(node[key])}")

    if not isinstance(node, dict):
        raise InvalidParameterError(f"json_schema: {where} must be a schema object, got {_got(node)}")
    if id(node) in seen:
        return
    seen.add(id(node))
    if "type" in node:
        types = node["type"]
        if not (isinstance(types, str) or (isinstance(types, list) and types and
                                           all(isinstance(t, str) for t in types))):
            raise bad("type", "a string or a list of type names")
        for t in [types] if isinstance(types, str) else types:
            if t not in TYPES:
                raise InvalidParameterError(f"json_schema: {where}.type has unknown type {t!r}; use one of "
                                            f"{', '.join(TYPES)}")
    if "required" in node and not (isinstance(node["required"], list) and
                                   all(isinstance(k, str) for k in node["required"])):
        raise bad("required", "a list of property names (strings)")
    for key in ("enum", *SCHEMA_LISTS):
        if key in node and not isinstance(node[key], list):
            raise bad(key, "a list")
    for key in ("pattern", "format", "$ref"):
        if key in node and not isinstance(node[key], str):
            raise bad(key, "a string")
    for key in BOUNDS:
        if key in node and (not isinstance(node[key], int) or isinstance(node[key], bool) or node[key] < 0):
            raise bad(key, "an integer >= 0")
    for key in RANGE:
        if key in node and (isinstance(node[key], bool) or not isinstance(node[key], (int, float))
                            or not math.isfinite(node[key])):
            raise bad(key, "a number")
    if isinstance(node.get("items"), list):
        raise bad("items", "a schema object (a list is the old tuple form: give the leading items' schemas "
                           "as prefixItems)")
    for key in ("items", "additionalProperties"):
        if key in node and not isinstance(node[key], (bool, dict)):
            raise bad(key, "true, false or a schema object")
        if isinstance(node.get(key), dict):
            _check_keywords(node[key], f"{where}.{key}", seen)
    for key in SUBSCHEMAS:
        if key in node and not isinstance(node[key], dict):
            raise bad(key, "an object mapping names to schemas")
        for name, sub in (node.get(key) or {}).items():
            _check_keywords(sub, f"{where}.{key}.{name}", seen)
    for key in SCHEMA_LISTS:
        for i, sub in enumerate(node.get(key) or []):
            _check_keywords(sub, f"{where}.{key}[{i}]", seen)


def _check(node, where: str, seen: set[int]) -> None:
    """Every schema reachable from node, each followed once (a recursive schema comes back to itself)."""
    if not isinstance(node, dict):
        raise InvalidParameterError(f"json_schema: {where} must be an object, got {type(node).__name__}")
    if id(node) in seen:
        return
    seen.add(id(node))
    for branch in branches(node):
        _check_one(branch or {}, where)
        for key, sub in ((branch or {}).get("properties") or {}).items():
            _check(sub, f"{where}.properties.{key}", seen)
        for key in ("items", "additionalProperties"):
            if isinstance((branch or {}).get(key), dict):
                _check(branch[key], f"{where}.{key}", seen)
        for i, sub in enumerate((branch or {}).get("prefixItems") or []):
            _check(sub, f"{where}.prefixItems[{i}]", seen)


def _check_one(node: dict, where: str) -> None:
    """The keywords of one alternative ($ref, allOf and anyOf already merged in)."""
    unsupported = [k for k in UNSUPPORTED if k in node]
    if unsupported:
        raise InvalidParameterError(f"json_schema: {where} uses {', '.join(unsupported)}, which JSON schema mode "
                                    "does not support (type, properties, required, additionalProperties, items, "
                                    "enum, const, $ref, anyOf, oneOf, allOf, and length, item and integer bounds)")
    types = node.get("type", [])
    for t in [types] if isinstance(types, str) else types:
        if t not in TYPES:
            raise InvalidParameterError(f"json_schema: {where} has unknown type {t!r}; use one of {', '.join(TYPES)}")
    for low, high in (BOUNDS[:2], BOUNDS[2:4], BOUNDS[4:]):
        for name in (low, high):
            if name in node and (not isinstance(node[name], int) or isinstance(node[name], bool) or node[name] < 0):
                raise InvalidParameterError(f"json_schema: {where}.{name} must be an integer >= 0")
        if node.get(low, 0) > node.get(high, node.get(low, 0)):
            raise InvalidParameterError(f"json_schema: {where} has {low} {node[low]} > {high} {node[high]}")
    for name in RANGE:
        if name in node and (isinstance(node[name], bool) or not isinstance(node[name], (int, float))
                             or not math.isfinite(node[name])):
            raise InvalidParameterError(f"json_schema: {where}.{name} must be a number")
    lo, hi = int_range(node)
    if _types(node) == {"integer"} and lo is not None and hi is not None and lo > hi:
        raise InvalidParameterError(f"json_schema: {where} leaves no integer between its bounds")
    if _types(node) == {"number"} and empty_range(node):
        raise InvalidParameterError(f"json_schema: {where} leaves no number between its bounds")
    check_pattern(node, where)
    keys, _ = _keys(node)
    missing = [k for k in node.get("required", []) if keys is not None and k not in keys]
    if missing:
        raise InvalidParameterError(f"json_schema: {where} requires {missing}, which its properties do not allow "
                                    "(no object could have them)")
    if len(set(node.get("required", []))) > node.get("maxProperties", math.inf) or (
            keys is not None and node.get("minProperties", 0) > len(keys)):
        raise InvalidParameterError(f"json_schema: {where} asks for a number of keys (minProperties, maxProperties, "
                                    "required, properties) no object can have")


def _strings(node: dict | None) -> list[str] | None:
    """The values a string may take, or None for any (an enum node is concrete: one type, its values)."""
    return node["enum"] if node and "enum" in node and node.get("type") == "string" else None


def _first(node: dict | None) -> str:
    """The characters a value of node may start with."""
    if node and "enum" in node and node.get("type") == "boolean":
        return "".join("t" if v else "f" for v in node["enum"])
    return "".join(FIRST[t] for t in _types(node))


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


class SchemaBranches(NamedTuple):
    """The states of the anyOf alternatives the text so far still fits; all share one JSON syntax state."""
    states: tuple

    @property
    def done(self) -> bool:
        return self.states[0].json.done


def start(schema: dict) -> SchemaBranches:
    return SchemaBranches(tuple(_expand(SchemaState(JsonState(), (), prepare(schema)))))


def _expand(state: SchemaState) -> list[SchemaState]:
    """state once per alternative its value's schema allows (itself for a schema without anyOf/oneOf)."""
    return [state._replace(expect=node) for node in branches(state.expect)] if state.expect else [state]


def _key(state: SchemaState) -> tuple:
    frames = tuple((id(f.node), f.seen, f.key, f.items) for f in state.frames)
    return state.json, frames, id(state.expect), state.text, state.count


def _allowed_keys(frame: Frame) -> set[str] | None:
    keys, _ = _keys(frame.node or {})
    return None if keys is None else keys - frame.seen


def _may_close(frame: Frame) -> bool:
    node = frame.node or {}
    return set(node.get("required", [])) <= frame.seen and len(frame.seen) >= node.get("minProperties", 0)


def _value_schema(frame: Frame, container: str) -> dict | None:
    node = frame.node or {}
    if container == "a":  # prefixItems: the schema of each leading item; items: of those after them
        index, leading = max(frame.items - 1, 0), node.get("prefixItems") or []
        return leading[index] if index < len(leading) else (node.get("items") or None)
    return (node.get("properties") or {}).get(frame.key, _keys(node)[1])


def _bounded_number(node: dict | None) -> bool:
    return _types(node) == {"number"} and has_range(node)


def _bound(node: dict | None, name: str) -> int | None:
    node = node or {}
    if name == "maxItems" and node.get("items") is False:  # no items past prefixItems
        return min(len(node.get("prefixItems") or []), node.get(name, math.inf))
    return node.get(name)


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
    elif mode == NUMBER and (ch in ".eE" and _types(expect) == {"integer"} or ch in "eE" and _bounded_number(expect)):
        return None
    in_array = js.stack[-1:] == "a"
    if mode in (START, VALUE) or (mode == ARRAY_FIRST and ch != "]"):
        if ch not in WS and ch not in _first(expect):
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
        if ch == '"' and patterns(expect) and not string_ok(expect, text, True):
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
        allowed, most = _allowed_keys(frames[-1]), _bound(frames[-1].node, "maxProperties")
        if ch in ',"' and ((allowed is not None and not allowed) or (most is not None and len(frames[-1].seen) >= most)):
            return None  # no key is left to write
    nxt = feed(js, ch)
    if nxt is None:
        return None
    if in_array and ((mode == ARRAY_FIRST and ch not in WS + "]") or (mode == AFTER and ch == ",")):
        frames = frames[:-1] + (frames[-1]._replace(items=frames[-1].items + 1),)  # an item starts
    ok = int_ok if _types(expect) == {"integer"} else number_ok if _bounded_number(expect) else None
    if ok is not None and nxt.mode == NUMBER and not ok(expect, nxt.part, False):
        return None
    if ok is not None and js.mode == NUMBER and nxt.mode != NUMBER and not ok(expect, js.part, True):
        return None  # the number would end out of range
    out = _follow(js, nxt, frames, expect, text, ch)
    if nxt.mode == STRING and nxt.part == "v" and patterns(expect) and not string_ok(expect, out.text, False):
        return None
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
    if nxt.mode in (STRING, ESCAPE, UNICODE):
        if js.mode not in (STRING, ESCAPE, UNICODE):
            return SchemaState(nxt, frames, expect, "")  # a string starts
        raw = nxt.part[:1] == "v" and bool(patterns(expect))  # a patterned string keeps its raw text, escapes too
        grow = raw or (js.mode == STRING and (nxt.part == "k" or _strings(expect) is not None))
        return SchemaState(nxt, frames, expect, text + ch if grow else text)
    if nxt.mode in (AFTER, KEY, COLON):
        return SchemaState(nxt, frames)
    return SchemaState(nxt, frames, expect, text)  # inside a number, a literal or an escape


def _checks_chars(state: SchemaState) -> bool:
    """Whether the string being read checks its characters (a key or enum list, a pattern): then a piece of a
    multi-byte character (U+FFFD) is checked as one."""
    js = state.json
    return _tracked(js, state.frames, state.expect) or (js.part[:1] == "v" and bool(patterns(state.expect)))


def schema_advance(branches_: SchemaBranches, text: str) -> SchemaBranches | None:
    states = branches_.states
    for ch in text:
        nxt: list[SchemaState] = []
        for state in states:
            js = state.json
            if ch == "\ufffd" and js.mode in (STRING, ESCAPE, UNICODE) and not _checks_chars(state):
                nxt.append(state)  # part of a multi-byte character in a free string
            elif (fed := schema_feed(state, ch)) is not None:
                nxt += _expand(fed) if fed.expect is not state.expect else [fed]
        if not nxt:
            return None
        if len(nxt) > 1:  # alternatives that have come back to the same state merge
            merged: dict = {}
            for state in nxt:
                merged.setdefault(_key(state), state)
            nxt = list(merged.values())[:MAX_BRANCHES]
        states = tuple(nxt)
    return SchemaBranches(states)
