"""JSON schema mode: what it accepts is what jsonschema validates, every valid instance gets through, SmolLM2
fills a schema, and what it cannot enforce is refused by name."""

import json
import random

import jsonschema
import pytest

from kvtool import SamplingParams
from kvtool.errors import InvalidParameterError
from kvtool.structured.json_schema import schema_advance, start

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "bb", "ab"]}},
    "pet": {"type": "object", "properties": {"kind": {"const": "cat"}, "w": {"type": "number"}}, "required": ["kind"]},
    "ok": {"type": ["boolean", "null"]}, "any": {}, "extra": {"type": "object", "additionalProperties": {"type": "integer"}}},
    "required": ["name", "age"], "additionalProperties": False}
PIECES = list('{}[]",: 0123456789.-+eE\n') + list("abcdefghijklmnopqrstuvwxyz") + [
    '"name"', '"age"', '"tags"', '"pet"', '"ok"', '"kind"', '"cat"', '"w"', '"bb"', '"any"', '"extra"', "true", "null",
    "false", "\\n", "\\u00e9", "na", "me", "é"]


def random_walk(schema: dict, rng: random.Random, steps: int, closers: str, pieces: list[str] = PIECES) -> str:
    """Pieces drawn at random among those the schema allows, leaning towards closing after a while: the text
    of a finished object (asserted: the walk never has no piece to go on with)."""
    state, text = start(schema), ""
    for step in range(steps):
        options = [(p, n) for p in pieces if (n := schema_advance(state, p)) is not None]
        assert options, f"stuck after {text!r}"
        closing = [o for o in options if o[0] in closers or o[1].done]
        piece, state = rng.choice(closing if closing and step > steps // 10 and rng.random() < 0.7 else options)
        text += piece
        if state.done:
            return text
    raise AssertionError(f"not done after {steps} pieces: {text!r}")


def test_random_walks_end_only_in_objects_the_schema_validates_and_never_get_stuck():
    rng = random.Random(0)
    for _ in range(400):
        jsonschema.validate(json.loads(random_walk(SCHEMA, rng, 400, '}]"')), SCHEMA)


def random_instance(rng: random.Random) -> dict:
    out = {"name": rng.choice(["", "Bo", "é ü", 'q"uote']), "age": rng.choice([0, -7, 31])}
    if rng.random() < 0.5:
        out["tags"] = rng.sample(["a", "bb", "ab"], rng.randrange(4))
    if rng.random() < 0.5:
        out["pet"] = {"kind": "cat", **({"w": rng.choice([1.5, -2e-3, 4])} if rng.random() < 0.5 else {})}
    if rng.random() < 0.5:
        out["ok"] = rng.choice([True, False, None])
    if rng.random() < 0.5:
        out["any"] = rng.choice([[1, {"x": None}], "s", 2.5, {}])
    if rng.random() < 0.5:
        out["extra"] = {"k1": 3, "k2": -1}
    keys = list(out)
    rng.shuffle(keys)
    return {k: out[k] for k in keys}


def test_every_valid_instance_passes_character_by_character():
    rng = random.Random(1)
    for i in range(300):
        text = json.dumps(random_instance(rng), indent=[None, 2][i % 2], ensure_ascii=bool(i % 3))
        state = start(SCHEMA)
        for j, ch in enumerate(text):
            state = schema_advance(state, ch)
            assert state is not None, (text, j)
        assert state.done


BOUNDED = {"type": "object", "properties": {
    "code": {"type": "string", "minLength": 2, "maxLength": 4},
    "ids": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
    "none": {"type": "array", "maxItems": 0},
    "n": {"type": "integer", "minimum": -5, "exclusiveMaximum": 40},
    "big": {"type": "integer", "minimum": 100},
    "grid": {"type": "array", "maxItems": 2, "items": {"type": "array", "maxItems": 2,
                                                      "items": {"type": "string", "maxLength": 1}}},
    "votes": {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 1, "maxProperties": 2}},
    "required": ["code", "ids"], "additionalProperties": False}


def test_length_and_item_bounds_hold_on_random_walks_and_let_valid_instances_through():
    rng = random.Random(2)
    for _ in range(300):
        jsonschema.validate(json.loads(random_walk(BOUNDED, rng, 300, '}]",')), BOUNDED)
    for _ in range(200):
        obj = {"code": "".join(rng.choice(['a', 'é', '\n', '"', 'z']) for _ in range(rng.randrange(2, 5))),
               "ids": [rng.randrange(-9, 99) for _ in range(rng.randrange(1, 4))], "none": [],
               "n": rng.randrange(-5, 40), "big": rng.choice([100, 101, 999, 12345678901234567890]),
               "grid": [[rng.choice(["", "x", "é"]) for _ in range(rng.randrange(3))] for _ in range(rng.randrange(3))],
               "votes": {k: rng.randrange(9) for k in rng.sample(["yes", "no", "a"], rng.randrange(1, 3))}}
        text = json.dumps(obj, ensure_ascii=rng.random() < 0.5)
        assert schema_advance(start(BOUNDED), text).done, text


@pytest.mark.parametrize("text", ['{"code": "a"', '{"code": "abcde', '{"code": "ab\\n\\n\\n', '{"ids": []',
                                  '{"ids": [1, 2, 3,', '{"none": [1', '{"grid": [[], [], ', '{"grid": [["xy',
                                  '{"n": -6', '{"n": 40', '{"n": 4, "n"', '{"n": 400', '{"n": --',
                                  '{"big": 99,', '{"big": -', '{"big": 0',
                                  '{"votes": {}', '{"votes": {"a": 1, "b": 2,', '{"votes": {"a": 1, "b": 2, "c"'])
def test_what_the_bounds_forbid_is_refused(text):
    assert schema_advance(start(BOUNDED), text) is None


def test_bad_bounds_are_refused_by_name():
    for bad, words in (({"minLength": -1}, "minLength must be"), ({"maxItems": "2"}, "maxItems must be"),
                       ({"minLength": 3, "maxLength": 2}, "minLength 3 > maxLength 2"),
                       ({"type": "integer", "minimum": 1.5, "maximum": 1.9}, "no integer"),
                       ({"type": "integer", "maximum": "9"}, "maximum must be a number"),
                       ({"minProperties": 2, "maxProperties": 1}, "minProperties 2 > maxProperties 1"),
                       ({"properties": {"x": {}}, "additionalProperties": False, "minProperties": 2}, "number of keys")):
        schema = {"type": "object", "properties": {"a": bad}}
        with pytest.raises(InvalidParameterError, match=words):
            SamplingParams(response_format="json_schema", json_schema=schema).validate()


def test_an_object_without_properties_or_more_keys_is_empty():
    closed = {"type": "object", "additionalProperties": False}
    assert schema_advance(start(closed), "{}").done and schema_advance(start(closed), '{"') is None
    assert schema_advance(start({"type": "object"}), '{"any": [1]}').done


@pytest.mark.parametrize("text", [
    '{"name": "x"}', '{"name": "x", "age": 3.5}', '{"name": 1', '{"nam": "x"}', '{"name": "x", "age": 3, "zz": 1}',
    '{"name": "x", "age": 3, "tags": ["c"]}', '{"name": "x", "age": 3, "pet": {}}', '{"name": "x", "name": "y"',
    '{"name": "x", "age": 3, "ok": 1}', '{"name": "x", "age": 1, "extra": {"k": "v"}}', '{"na\\u006de": 1'])
def test_what_the_schema_forbids_is_refused(text):
    state = schema_advance(start(SCHEMA), text)
    assert state is None or not state.done


@pytest.mark.parametrize("schema,words", [
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "schema.properties.a uses not"),
    ({"type": "object", "properties": {"a": {"anyOf": [{"type": "string"}, {"if": {}}]}}}, "properties.a uses if"),
    ({"$ref": "#/$defs/x", "$defs": {}}, "'#/$defs/x' points to nothing"),
    ({"$ref": "https://example.com/s.json"}, "not a pointer into this schema"),
    ({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}, "a reference or alternative"),
    ({"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}, "$defs": {"a": {"anyOf": [{"$ref": "#/$defs/a"}]}}},
     "alternative that refers to itself"),
    ({"type": "object", "allOf": [{"properties": {"a": {"type": "string"}}}, {"properties": {"a": {"type": "null"}}}]},
     "property 'a' differently"),
    ({"type": "object", "properties": {"n": {"enum": [1, 2.5]}}}, "2.5 is not a string, integer"),
    ({"type": "object", "properties": {"n": {"type": "string", "enum": [1, 2]}}}, "no enum or const value has"),
    ({"type": "string"}, "root must be an object"),
    ({"type": "object", "properties": {"a": {"type": "float"}}}, "unknown type 'float'"),
    ({"type": "object", "properties": {"a": {}}, "required": ["b"]}, "requires ['b']")])
def test_schemas_it_cannot_enforce_are_refused_by_name(schema, words):
    with pytest.raises(InvalidParameterError, match="json_schema"):
        SamplingParams(response_format="json_schema", json_schema=schema).validate()
    try:
        SamplingParams(response_format="json_schema", json_schema=schema).validate()
    except InvalidParameterError as exc:
        assert words in str(exc)
    with pytest.raises(InvalidParameterError, match="exactly when"):
        SamplingParams(response_format="json_object", json_schema={"type": "object"}).validate()


@pytest.mark.real_model
def test_smollm2_fills_the_schema(smollm2):
    from kvtool.engine import Engine

    schema = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"},
                                               "population": {"type": "integer"},
                                               "size": {"enum": ["small", "medium", "large"]}},
              "required": ["city", "country", "population", "size"], "additionalProperties": False}
    engine = Engine(smollm2)
    prompt = smollm2.encode(smollm2.render([{"role": "user", "content": "Describe Paris as JSON."}]))
    params = [SamplingParams(temperature=0, max_tokens=80, response_format="json_schema", json_schema=schema)] + [
        SamplingParams(temperature=0.8, seed=s, max_tokens=80, response_format="json_schema", json_schema=schema)
        for s in range(3)]
    for gen in engine.generate_batch([prompt] * 4, params):
        assert gen.finish_reason == "stop", gen.text
        jsonschema.validate(json.loads(gen.text), schema)


@pytest.mark.real_model
def test_smollm2_keeps_to_length_and_item_bounds(smollm2):
    from kvtool.engine import Engine

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                               "rivers": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                          "minItems": 2, "maxItems": 2}},
              "required": ["name", "rivers"], "additionalProperties": False}
    engine = Engine(smollm2)
    prompt = smollm2.encode(smollm2.render([{"role": "user", "content": "Describe France and its rivers as JSON."}]))
    unbounded = {"name": {"type": "string"}, "rivers": {"type": "array", "items": {"type": "string"}}}
    free = SamplingParams(temperature=0, max_tokens=120, response_format="json_schema",
                          json_schema={**schema, "properties": unbounded})
    loose = engine.generate(prompt, free).run()
    assert loose.finish_reason == "length"  # without bounds, the list of rivers repeats itself past max_tokens
    gen = engine.generate(prompt, SamplingParams(temperature=0, max_tokens=120, response_format="json_schema",
                                                 json_schema=schema)).run()
    assert gen.finish_reason == "stop", gen.text
    jsonschema.validate(json.loads(gen.text), schema)


@pytest.mark.real_model
def test_smollm2_keeps_integers_in_range(smollm2):
    from kvtool.engine import Engine

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                               "age": {"type": "integer", "minimum": 18, "maximum": 65},
                                               "floor": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 100}},
              "required": ["name", "age", "floor"], "additionalProperties": False}
    engine = Engine(smollm2)
    prompt = smollm2.encode(smollm2.render([{"role": "user", "content": "Describe a child who lives on the ground "
                                                                        "floor, as JSON."}]))
    params = [SamplingParams(temperature=0, max_tokens=60, response_format="json_schema", json_schema=schema)] + [
        SamplingParams(temperature=1.0, seed=s, max_tokens=60, response_format="json_schema", json_schema=schema)
        for s in range(4)]
    for gen in engine.generate_batch([prompt] * len(params), params):
        assert gen.finish_reason == "stop", gen.text
        jsonschema.validate(json.loads(gen.text), schema)
    unbounded = {**schema, "properties": {**schema["properties"], "floor": {"type": "integer"}}}
    free = engine.generate(prompt, SamplingParams(temperature=0, max_tokens=60, response_format="json_schema",
                                                  json_schema=unbounded)).run()
    assert json.loads(free.text)["floor"] >= 100  # left alone, greedy writes 123456789
