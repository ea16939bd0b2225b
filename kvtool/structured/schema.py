"""Walks over a JSON Schema as a tree: every subschema with its path, and copies without some keywords.

A schema's keywords are searched only where schemas can be: property and definition names are names, and the
values of enum/const/default/examples are data, never keywords.
"""

from __future__ import annotations

from collections.abc import Callable

DATA = ("enum", "const", "default", "examples")  # values, not schemas: never searched for keywords
NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name -> schema maps


def subschemas(node, path: str = "schema"):
    """(path, schema) for node and every schema inside it; property and definition names are names, not keywords,
    and enum/const/default/examples are values."""
    if isinstance(node, dict):
        yield path, node
        for key, value in node.items():
            if key in NAMED and isinstance(value, dict):
                for name, sub in value.items():
                    yield from subschemas(sub, f"{path}.{key}.{name}")
            elif key not in DATA:
                yield from subschemas(value, f"{path}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from subschemas(value, f"{path}[{i}]")


def where(schema, keyword: str) -> list[str]:
    """The paths of the subschemas that use keyword (`schema.properties.tags`)."""
    return [path for path, node in subschemas(schema) if keyword in node]


def without(schema, drop: Callable[[str, object], bool]):
    """A copy of schema without the keywords (key, value) for which drop is true, wherever a schema can be; a
    property or definition named like a keyword stays."""
    def walk(node, named: bool = False):
        if isinstance(node, dict):
            if named:
                return {k: walk(v) for k, v in node.items()}
            return {k: (v if k in DATA else walk(v, k in NAMED)) for k, v in node.items() if not drop(k, v)}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    return walk(schema)
