"""References and combinators for JSON schema mode: what lets a Pydantic model's schema through.

prepare() copies a schema and links each `$ref` node to the node it points to (pointers into the same
schema only: `#`, `#/$defs/Name`, `#/definitions/Name`, any `#/...`). Links may form cycles: that is how
a recursive schema (a tree whose children are trees) is followed, one value at a time. concrete() gives
the schema a value follows, with its `$ref` target and `allOf` parts merged in and an enum of several
kinds (strings, integers, booleans, null) split into one `anyOf` branch per kind. branches() splits a
node with `anyOf` or `oneOf` into one node per alternative (the node's other keywords apply to each);
JSON schema mode follows them side by side until the text rules some out. oneOf is read as anyOf: a
text matching two alternatives is not refused.
"""

from __future__ import annotations

import copy

from kvtool.errors import InvalidParameterError

LINK = "\x00target"  # in a prepared schema: the node a $ref points to
DATA = ("enum", "const", "default", "examples")  # values, not schemas: never searched for $ref
DOC = ("title", "description", "default", "examples", "$comment", "$schema", "$id", "format", "deprecated",
       "readOnly", "writeOnly", "discriminator")  # kept from the first part that has them
LOWER = ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties")  # merged: the largest holds
UPPER = ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties")  # merged: the smallest holds
MAX_DEPTH = 32  # $ref, allOf and anyOf nesting followed before a value's schema must be known
ALL = ("object", "array", "string", "number", "integer", "boolean", "null")


def bad(message: str) -> InvalidParameterError:
    return InvalidParameterError(f"json_schema: {message}")


def prepare(schema: dict) -> dict:
    """A copy of schema whose $ref nodes carry a link (LINK) to their target in the copy."""
    root = copy.deepcopy(schema)

    def link(node, where: str) -> None:
        if isinstance(node, dict):
            if "$ref" in node:
                node[LINK] = _target(root, node["$ref"], where)
            for key, value in node.items():
                if key not in DATA and key != LINK:
                    link(value, f"{where}.{key}")
        elif isinstance(node, list):
            for i, value in enumerate(node):
                link(value, f"{where}[{i}]")

    link(root, "schema")
    return root


def _target(root: dict, ref, where: str) -> dict:
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        raise bad(f"{where}.$ref {ref!r} is not a pointer into this schema ('#/$defs/Name'); JSON schema mode "
                  "follows no other documents")
    node = root
    for part in ref.split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise bad(f"{where}.$ref {ref!r} points to nothing in the schema")
    if not isinstance(node, dict):
        raise bad(f"{where}.$ref {ref!r} points to a {type(node).__name__}, not a schema object")
    return node


def rebase(schema: dict, base: str) -> dict:
    """A copy of schema for use at pointer `base` of a larger one: its '#...' references made to start there."""
    out = copy.deepcopy(schema)

    def walk(node) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("$ref"), str) and node["$ref"].startswith("#"):
                node["$ref"] = base + node["$ref"][1:]
            for key, value in node.items():
                if key not in DATA:
                    walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(out)
    return out


def types_of(node: dict | None) -> set[str]:
    if not node:
        return set(ALL)
    types = node.get("type")
    if types is None:
        return {"object"} if "properties" in node else {"array"} if "items" in node or "prefixItems" in node \
            else set(ALL)
    return {types} if isinstance(types, str) else set(types)


def _widen(types: set[str]) -> set[str]:
    return types | {"integer"} if "number" in types else types  # an integer is a number


def _same(a, b) -> bool:
    try:
        return a is b or a == b
    except RecursionError:  # two distinct recursive schemas
        return False


def merge(parts: list[dict]) -> dict:
    """One schema every part holds in: properties and required joined, types intersected, the tightest bound
    kept; any other keyword must agree between parts (refused by name otherwise)."""
    out: dict = {}
    for part in parts:
        for key, value in part.items():
            if key not in out:
                out[key] = value
            elif key == "properties":
                clash = [k for k in value if k in out[key] and not _same(value[k], out[key][k])]
                if clash:
                    raise bad(f"allOf/$ref parts describe property {clash[0]!r} differently; JSON schema mode "
                              "merges parts only when they agree")
                out[key] = {**out[key], **value}
            elif key == "required":
                out[key] = list(dict.fromkeys([*out[key], *value]))
            elif key == "type":
                both = _widen(types_of({"type": out[key]})) & _widen(types_of({"type": value}))
                if not both:
                    raise bad(f"allOf/$ref parts allow no common type ({out[key]!r} and {value!r})")
                out[key] = sorted(both)
            elif key in LOWER or key in UPPER:
                out[key] = (max if key in LOWER else min)(out[key], value)
            elif key == "additionalProperties":
                if value is False or out[key] is True:
                    out[key] = value
                elif value is not True and out[key] is not False and not _same(value, out[key]):
                    raise bad("allOf/$ref parts give different additionalProperties schemas")
            elif key not in DOC and key != LINK and not _same(value, out[key]):
                raise bad(f"allOf/$ref parts give different {key!r}; JSON schema mode merges parts only when "
                          "they agree")
    return out


def _kind(value) -> str | None:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, str):
        return "string"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"
    return None


def _enum_kinds(node: dict) -> dict:
    """An enum or const as one node per kind of value, each with one type and its values."""
    values = node["enum"] if "enum" in node else [node["const"]]
    if not isinstance(values, list) or not values:
        raise bad("enum must be a non-empty list")
    kinds: dict[str, list] = {}
    for value in values:
        kind = _kind(value)
        if kind is None:
            raise bad(f"enum or const value {value!r} is not a string, integer, boolean or null; JSON schema "
                      "mode enforces only those")
        if kind == "string" and ("\\" in value or '"' in value):
            raise bad(f"enum or const string {value!r} holds a quote or backslash; JSON schema mode takes no "
                      "escapes in enums")
        kinds.setdefault(kind, []).append(int(value) if kind == "integer" else value)
    allowed = types_of(node) if "type" in node else set(ALL)
    if "number" in allowed:
        allowed.add("integer")
    rest = {k: v for k, v in node.items() if k not in ("enum", "const", "type")}
    alts = [{**rest, "type": kind, "enum": vals} for kind, vals in kinds.items() if kind in allowed]
    if not alts:
        raise bad(f"no enum or const value has the type {node['type']!r} (nothing could be written)")
    if len(alts) == 1:
        return alts[0]
    if "anyOf" in rest or "oneOf" in rest:
        raise bad("an enum of several kinds cannot sit beside anyOf/oneOf in one schema")
    return {**rest, "anyOf": [{"type": a["type"], "enum": a["enum"]} for a in alts]}


def concrete(node: dict | None, depth: int = 0) -> dict | None:
    """The schema a value follows, with its $ref target and allOf parts merged in (enums as above)."""
    if not node:
        return node
    if depth > MAX_DEPTH:
        raise bad(f"$ref, allOf and anyOf nest deeper than {MAX_DEPTH} before a value's schema is known (a "
                  "reference or alternative that refers to itself?)")
    if "$ref" in node or "allOf" in node:
        parts = [{k: v for k, v in node.items() if k not in ("$ref", LINK, "allOf")}]
        if "$ref" in node:
            parts.append(concrete(node[LINK], depth + 1) or {})
        allof = node.get("allOf", [])
        if not isinstance(allof, list) or not all(isinstance(p, dict) for p in allof):
            raise bad("allOf must be a list of schema objects")
        parts += [concrete(p, depth + 1) or {} for p in allof]
        node = merge(parts)
    if "enum" in node or "const" in node:
        node = _enum_kinds(node)
    return node


def branches(node: dict | None, depth: int = 0) -> list[dict | None]:
    """The alternatives a value may follow: [node] itself unless it has anyOf/oneOf (each alternative merged
    with the node's other keywords, nested alternatives flattened)."""
    node = concrete(node, depth)
    if not node or ("anyOf" not in node and "oneOf" not in node):
        return [node]
    if "anyOf" in node and "oneOf" in node:
        raise bad("a schema with both anyOf and oneOf is not supported; nest one inside the other's alternatives")
    alts = node.get("anyOf", node.get("oneOf"))
    if not isinstance(alts, list) or not alts or not all(isinstance(a, dict) for a in alts):
        raise bad("anyOf/oneOf must be a non-empty list of schema objects")
    rest = {k: v for k, v in node.items() if k not in ("anyOf", "oneOf")}
    out: list = []
    for alt in alts:
        out += branches(merge([rest, concrete(alt, depth + 1) or {}]), depth + 1)
    return out
