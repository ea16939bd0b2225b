"""Parse and validate tool-call arguments before anything runs.

Errors here are the model's to fix, so the messages quote what was wrong and what the
schema wants; they are never retried and never count against the circuit breaker.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
from jsonschema.exceptions import best_match

from kvtool.agent.tools import Tool


class ArgumentError(Exception):
    pass


# keyed by id() but holding the schema itself, so an id is never reused while cached
_validators: dict[int, tuple[dict, jsonschema.protocols.Validator]] = {}


def _validator(tool: Tool) -> jsonschema.protocols.Validator:
    cached = _validators.get(id(tool.parameters))
    if cached is None or cached[0] is not tool.parameters:
        cls = jsonschema.validators.validator_for(tool.parameters, default=jsonschema.Draft202012Validator)
        cached = _validators[id(tool.parameters)] = (tool.parameters, cls(tool.parameters))
    return cached[1]


def _schema_hint(tool: Tool) -> str:
    props = tool.parameters.get("properties", {})
    required = set(tool.parameters.get("required", []))
    parts = [f"{k}{'' if k in required else '?'}: {v.get('type', 'any')}" for k, v in props.items()]
    return "{" + ", ".join(parts) + "}"


def parse_arguments(tool: Tool, raw: str) -> dict[str, Any]:
    """The validated argument object, or ArgumentError with a message for the model."""
    text = raw.strip() or "{}"
    try:
        args = json.loads(text)
    except json.JSONDecodeError as exc:
        snippet = text if len(text) <= 200 else text[:200] + "…"
        raise ArgumentError(
            f"arguments for {tool.name} are not valid JSON ({exc.msg} at character {exc.pos}): {snippet!r}. "
            f"Send the call again with a JSON object like {_schema_hint(tool)}."
        ) from None
    if not isinstance(args, dict):
        raise ArgumentError(
            f"arguments for {tool.name} must be a JSON object, got {type(args).__name__}: {text[:200]!r}. "
            f"Expected {_schema_hint(tool)}."
        )
    error = best_match(_validator(tool).iter_errors(args))
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "the arguments"
        raise ArgumentError(
            f"invalid arguments for {tool.name}: {error.message} (at {where}). "
            f"Expected {_schema_hint(tool)}; fix the arguments and call again."
        )
    return args
