"""Bad or huge input to structured output is refused up front, or compiled fast, never a hang or a crash:
patterns with huge repeats, recursion or exponential backtracking (regex mode and a JSON schema's `pattern`),
and schema keywords of the wrong JSON type (found by fuzzing the server, where they were OOM kills and 500s)."""

import time

import pytest

from kvtool.config import SamplingParams
from kvtool.errors import InvalidParameterError

HANG_S = 5.0  # not a speed claim: a bound far above any real compile, below a stalled server


def outcome(**kw) -> str:
    t = time.perf_counter()
    try:
        SamplingParams(**kw).validate()
        result = "ok"
    except InvalidParameterError as exc:
        result = str(exc)
    assert time.perf_counter() - t < HANG_S
    return result


@pytest.mark.parametrize("pattern", [
    "a{100000000}", "a{10000000}", "(?:a{100}){100}", "(?:a{0,1000}){1000}", "a{1000}" * 20, "()" * 2001,
    "(a|aa)+b", "(?:a|aa)+b", r"\d{4}-\d{2}-\d{2}", r"\(\d{3}\) \d{3}-\d{4}", r"\w{1,64}", "[a-z]{2,1000}",
    r"a\{1000000\}", "[a{1000000}]", r"\p{L}{3}", "abcdefghij" * 390, "[a-z]" * 790, "(ab", "a{4294967296}",
    "(" * 1900 + ")" * 1900])
def test_patterns_compile_or_are_refused_fast(pattern):
    result = outcome(regex=pattern)
    assert result == "ok" or result.startswith("invalid sampling parameter regex: the regex"), result


def test_a_schema_pattern_is_held_to_the_same_compiler():
    for pattern in ("a{10000000}", "(a|aa)+b", "(ab"):
        schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": pattern}}}
        result = outcome(response_format="json_schema", json_schema=schema)
        assert result == "ok" or "json_schema" in result, result


def obj(**kw) -> dict:
    return {"type": "object", **kw}


@pytest.mark.parametrize("schema", [
    {"type": 5}, obj(properties={"age": {"type": 5}}), obj(properties={"a": {"type": ["string", 5]}}),
    obj(properties={"a": {"type": []}}), obj(required=5), obj(required=None), obj(required=[5]), obj(properties=[]),
    {"type": "object", "properties": None}, obj(additionalProperties={"type": 5}), obj(additionalProperties=5),
    obj(properties={"a": {"type": "array", "items": 5}}), obj(properties={"a": {"type": "array", "prefixItems": [5]}}),
    obj(properties={"a": {"type": "string", "enum": 5}}), obj(**{"$defs": 5}),
    obj(**{"$defs": {"x": 5}}, properties={"a": {"$ref": "#/$defs/x"}}), obj(properties={"a": {"$ref": "#/nowhere"}}),
    obj(properties={"a": {"type": "string", "pattern": 5}}), obj(properties={"a": {"type": "number", "minimum": "x"}}),
    obj(properties={"a": {"type": "string", "minLength": 1.5}}), obj(properties={"a": {"type": "string",
                                                                                        "maxLength": -1}}),
    obj(minProperties="x"), obj(properties={"a": {"allOf": 5}}), obj(properties={"a": {"anyOf": [5]}})])
def test_schema_keywords_of_the_wrong_type_or_unsatisfiable_are_refused_with_a_reason(schema):
    result = outcome(response_format="json_schema", json_schema=schema)
    assert result.startswith("invalid sampling parameter json_schema: the JSON schema cannot be enforced: "), result
    assert len(result) > len("invalid sampling parameter json_schema: the JSON schema cannot be enforced: ") + 5


@pytest.mark.real_model
def test_huge_and_backtracking_patterns_run_on_smollm2_without_stalling(smollm2):
    from kvtool.engine import Engine

    engine = Engine(smollm2)
    prompt = smollm2.encode_chat([{"role": "user", "content": "Say a."}])
    t = time.perf_counter()  # a repeat too large for the lexer is refused when the matcher is built
    with pytest.raises(InvalidParameterError, match="too many expressions"):
        engine.generate(prompt, SamplingParams(temperature=0, max_tokens=12, regex="a{100000000}")).run()
    gen = engine.generate(prompt, SamplingParams(temperature=0, max_tokens=12, regex="(?:a|aa)+b")).run()
    assert time.perf_counter() - t < 60 and set(gen.text) <= {"a", "b"} and gen.text, gen.text
