"""Compile coverage on the JSONSchemaBench sample (tests/data/jsonschemabench) beside xgrammar, vLLM's default
structured-output backend: kvtool without strict compiles at least every schema xgrammar does, and says what it
leaves out, which xgrammar does not. Runs where vLLM brings xgrammar (.venv-vllm); compiles text only, no model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtool import SamplingParams
from kvtool.errors import InvalidParameterError

xgr = pytest.importorskip("xgrammar", reason="xgrammar comes with vLLM (.venv-vllm)")

SCHEMAS = sorted((Path(__file__).parent / "data" / "jsonschemabench").rglob("*.json"))


def xgrammar_compiles(schema) -> bool:
    """As vLLM's xgrammar backend compiles a schema with compact JSON (any_whitespace=False)."""
    try:
        xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
        return True
    except Exception:  # xgrammar raises RuntimeError / ValueError with its reason
        return False


def kvtool_compiles(schema, strict: bool) -> bool:
    try:
        SamplingParams(response_format="json_schema", json_schema=schema, strict=strict).validate()
        return True
    except InvalidParameterError:
        return False


def test_without_strict_kvtool_compiles_every_schema_xgrammar_compiles():
    schemas = [json.loads(p.read_text()) for p in SCHEMAS]
    theirs = [xgrammar_compiles(s) for s in schemas]
    lenient = [kvtool_compiles(s, False) for s in schemas]
    strict = [kvtool_compiles(s, True) for s in schemas]
    print(f"{len(schemas)} schemas: xgrammar {sum(theirs)}, kvtool without strict {sum(lenient)}, "
          f"with strict {sum(strict)}")
    missed = [str(p.relative_to(p.parents[1])) for p, x, k in zip(SCHEMAS, theirs, lenient) if x and not k]
    assert not missed and sum(lenient) >= sum(theirs) > sum(strict), missed
