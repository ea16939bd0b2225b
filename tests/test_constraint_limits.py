"""Bad input to structured output is refused up front with a message naming what is wrong: patterns that
would exhaust memory or never finish matching (regex mode and a JSON schema's `pattern`), and schema
keywords of the wrong JSON type (found by fuzzing the server, where they were OOM kills and 500s)."""

import time

import pytest

from kvtool.config import SamplingParams
from kvtool.errors import InvalidParameterError
from kvtool.structured.json_schema import check_schema
from kvtool.structured.regex_mode import MAX_REPEAT, RegexConstraint, compile_pattern

PIECES, SPECIAL, STOP = ["", "a", "b", "<|im_end|>"], {3}, {3}
HANG_S = 5.0  # not a speed claim: compiling a{10000000} took 9 s and 5 GB, a{100000000} ran out of memory


@pytest.mark.parametrize("pattern,words", [
    ("a{100000000}", "repeat count 100000000 in the pattern exceeds the limit 1000"),
    ("a{10000000}", "repeat count 10000000 "), ("a{1001}", "repeat count 1001 "), ("a{2000,}", "repeat count 2000 "),
    ("a{5,2000}", "repeat count 2000 "), ("a{,2000}", "repeat count 2000 "), ("(?x)a{2 0 0 0}", "repeat count 2000 "),
    ("(?:a{100}){100}", "multiply to 10000"), ("(?:(?:a{10}){10}){11}", "multiply to 1100"),
    ("(?:a{0,1000}){1000}", "multiply to 1000000"),
    ("a{1000}" * 20, "too large once its repeats are written out"), ("()" * 2001, "4002 characters long"),
    ("(?R)", "recursion"), ("(?0)", "recursion"), ("a(?R)?b", "recursion"), ("(?1)(a)", "recursion"),
    ("(?&x)(?P<x>a)", "recursion"), ("(?P>x)(?P<x>a)", "recursion"),
    ("(ab", "not a valid regular expression"), ("a**", "not a valid regular expression"),
    ("a{4294967296}", "not a valid regular expression"), ("(" * 1900 + ")" * 1900, "nests groups too deeply")])
def test_patterns_that_would_exhaust_memory_or_never_match_are_refused_fast(pattern, words):
    t = time.perf_counter()
    with pytest.raises(InvalidParameterError, match=words.replace("(", r"\(")):
        compile_pattern(pattern)
    assert time.perf_counter() - t < HANG_S
    with pytest.raises(InvalidParameterError, match=r"invalid sampling parameter regex=.*" + words.replace("(", r"\(")):
        RegexConstraint(PIECES, SPECIAL, STOP, pattern)
    with pytest.raises(InvalidParameterError, match=r"invalid sampling parameter regex=.*" + words.replace("(", r"\(")):
        SamplingParams(regex=pattern).validate()  # what the server checks before queueing the request


@pytest.mark.parametrize("pattern", [
    r"\d{4}-\d{2}-\d{2}", r"\(\d{3}\) \d{3}-\d{4}", r"\w{1,64}", "[a-z]{2,1000}", f"a{{{MAX_REPEAT}}}",
    "(?:a{10}){100}", "a{1000,}", "a{,5}", r"a\{1000000\}", "[a{1000000}]", "x{", "x{}", "(?V1)[[a]{2000}]",
    r"\p{L}{3}", "(?:abc){e<=1}", "(?#[)a{3}", "ab{1000}" * 9, "abcdefghij" * 390, "[a-z]" * 790])
def test_real_world_and_edge_patterns_compile_fast(pattern):
    t = time.perf_counter()
    compiled = compile_pattern(pattern)
    assert time.perf_counter() - t < HANG_S
    assert compiled.fullmatch("", partial=True) is not None


def test_literal_braces_and_classes_are_not_read_as_repeats():
    assert compile_pattern(r"a\{5000\}").fullmatch("a{5000}")
    assert compile_pattern("[{5000}]+").fullmatch("{50}")
    assert compile_pattern("a{,2}").fullmatch("aa") and not compile_pattern("a{,2}").fullmatch("aaa")


def test_a_schema_pattern_is_held_to_the_same_limits():
    for pattern, words in (("a{10000000}", "repeat count 10000000"), ("(?R)", "recursion")):
        schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": pattern}}}
        t = time.perf_counter()
        with pytest.raises(InvalidParameterError, match=rf"json_schema: schema.properties.a.pattern .*{words}"):
            check_schema(schema)
        assert time.perf_counter() - t < HANG_S


def obj(**kw) -> dict:
    return {"type": "object", **kw}


@pytest.mark.parametrize("schema,words", [
    ({"type": 5}, "schema.type must be a string or a list of type names, got 5"),
    (obj(properties={"age": {"type": 5}}), "schema.properties.age.type must be a string or a list of type names"),
    (obj(properties={"a": {"type": ["string", 5]}}), "schema.properties.a.type must be"),
    (obj(properties={"a": {"type": []}}), "schema.properties.a.type must be"),
    (obj(required=5), "schema.required must be a list of property names \\(strings\\), got 5"),
    (obj(required=None), "schema.required must be a list .*got null"),
    (obj(required=[5]), "schema.required must be a list"),
    (obj(properties=[]), "schema.properties must be an object mapping names to schemas, got \\[\\]"),
    ({"type": "object", "properties": None}, "schema.properties must be an object"),
    (obj(additionalProperties={"type": 5}), "schema.additionalProperties.type must be a string"),
    (obj(additionalProperties=5), "schema.additionalProperties must be true, false or a schema object, got 5"),
    (obj(properties={"a": {"type": "array", "items": [1]}}), "schema.properties.a.items .*prefixItems"),
    (obj(properties={"a": {"type": "array", "items": 5}}), "schema.properties.a.items must be true, false or a"),
    (obj(properties={"a": {"type": "array", "prefixItems": [5]}}), "schema.properties.a.prefixItems\\[0\\] must be a"),
    (obj(properties={"a": {"type": "string", "enum": 5}}), "schema.properties.a.enum must be a list"),
    (obj(**{"$defs": 5}), "schema.\\$defs must be an object mapping names to schemas"),
    (obj(**{"$defs": {"x": 5}}, properties={"a": {"$ref": "#/$defs/x"}}), "schema.\\$defs.x must be a schema object"),
    (obj(properties={"a": {"type": "string", "pattern": 5}}), "schema.properties.a.pattern must be a string"),
    (obj(properties={"a": {"type": "string", "format": 5}}), "schema.properties.a.format must be a string"),
    (obj(properties={"a": {"type": "number", "minimum": "x"}}), 'schema.properties.a.minimum must be a number, got "x"'),
    (obj(properties={"a": {"type": "integer", "minimum": True}}), "schema.properties.a.minimum must be a number, got true"),
    (obj(properties={"a": {"type": "string", "minLength": 1.5}}), "schema.properties.a.minLength must be an integer >= 0, got 1.5"),
    (obj(properties={"a": {"type": "string", "maxLength": -1}}), "schema.properties.a.maxLength must be an integer >= 0, got -1"),
    (obj(minProperties="x"), "schema.minProperties must be an integer >= 0"),
    (obj(properties={"a": {"allOf": 5}}), "schema.properties.a.allOf must be a list"),
    (obj(properties={"a": {"anyOf": [5]}}), "schema.properties.a.anyOf\\[0\\] must be a schema object"),
    (obj(properties={"a": {"allOf": [{"minimum": 1}, {"minimum": "x"}]}}), "schema.properties.a.allOf\\[1\\].minimum must be a number"),
    (obj(properties={"a": True}), "schema.properties.a must be a schema object, got true")])
def test_schema_keywords_of_the_wrong_type_are_refused_with_their_path(schema, words):
    with pytest.raises(InvalidParameterError, match=f"json_schema: {words}"):
        check_schema(schema)


def test_a_match_that_backtracks_exponentially_fails_the_request_instead_of_stalling():
    c = RegexConstraint(PIECES, SPECIAL, STOP, "(?:a|aa)+b")
    c.state = "a" * 60  # each "a" matches two ways: 2^60 paths to fail on "a"
    t = time.perf_counter()
    with pytest.raises(InvalidParameterError, match="regex=.*backtracks exponentially"):
        c.next_state(1)
    assert time.perf_counter() - t < HANG_S
