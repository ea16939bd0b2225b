"""JSON schema mode with $ref, $defs, allOf, anyOf/oneOf and enums of several kinds: Pydantic models' schemas,
recursive ones included, checked against pydantic and jsonschema both ways."""

from __future__ import annotations

import json
import random
from enum import Enum
from typing import Literal, Optional, Union

import jsonschema
import pytest
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvtool import SamplingParams
from kvtool.errors import InvalidParameterError
from kvtool.structured.json_schema import MAX_BRANCHES, schema_advance, start
from kvtool.structured.schema_refs import rebase
from tests.test_json_schema import random_walk


class Colour(str, Enum):
    red = "red"
    green = "green"


class Address(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: str = Field(max_length=6)
    zip: Optional[int] = None


class Tree(BaseModel):
    model_config = ConfigDict(extra="forbid")
    label: str
    children: list[Tree] = []


class Person(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=120)
    colour: Colour
    level: Literal[1, 2, 30]
    home: Address = Field(description="where they live")
    past: list[Address] = []
    note: Optional[str] = None
    tree: Optional[Tree] = None
    tag: Union[str, int, None] = None
    flag: Literal[True] = True
    pair: tuple[Colour, int] = (Colour.red, 1)


SCHEMA = Person.model_json_schema()
KEYS = ["name", "age", "colour", "level", "home", "past", "note", "tree", "tag", "flag", "city", "zip", "label",
        "children", "pair"]
PIECES = list('{}[]",: 0123456789-.e') + list("abcdefghijklmnopqrstuvwxyz") + [f'"{k}"' for k in KEYS] + [
    '"red"', '"green"', "true", "false", "null", "30", "1", "é"]


def valid(text: str) -> Person:
    obj = json.loads(text)
    jsonschema.validate(obj, SCHEMA)
    return Person.model_validate_json(text)


def test_pydantic_schema_uses_what_this_mode_now_follows():
    text = json.dumps(SCHEMA)
    assert all(word in text for word in ('"$ref"', '"$defs"', '"anyOf"', '"const"', '"enum": [1, 2, 30]',
                                         '"prefixItems"'))
    assert SCHEMA["$defs"]["Tree"]["properties"]["children"]["items"] == {"$ref": "#/$defs/Tree"}  # recursive
    SamplingParams(response_format="json_schema", json_schema=SCHEMA).validate()


def test_random_walks_end_only_in_objects_pydantic_validates():
    rng = random.Random(0)
    for _ in range(150):
        valid(random_walk(SCHEMA, rng, 500, '}]"', PIECES))


def random_tree(rng: random.Random, depth: int) -> Tree:
    kids = [random_tree(rng, depth - 1) for _ in range(rng.randrange(3))] if depth else []
    return Tree(label=rng.choice(["", "a", "é\n"]), children=kids)


def random_person(rng: random.Random) -> Person:
    address = lambda: Address(city=rng.choice(["", "Paris", "Köln"]), zip=rng.choice([None, 0, 75001, -3]))
    return Person(name=rng.choice(["", "Bo", 'q"t']), age=rng.choice([0, 7, 120]), colour=rng.choice(list(Colour)),
                  level=rng.choice([1, 2, 30]), home=address(), past=[address() for _ in range(rng.randrange(3))],
                  note=rng.choice([None, "x"]), tree=rng.choice([None, random_tree(rng, 4)]),
                  tag=rng.choice([None, "t", 12, -1]), pair=(rng.choice(list(Colour)), rng.randrange(-5, 5)))


def test_every_valid_instance_passes_character_by_character():
    rng = random.Random(1)
    for i in range(150):
        person = random_person(rng)
        # indent 1: a deep tree at indent 2 runs past MAX_WS (16 whitespace characters in a row)
        text = person.model_dump_json() if i % 2 else json.dumps(person.model_dump(mode="json"), indent=1)
        state = start(SCHEMA)
        for j, ch in enumerate(text):
            state = schema_advance(state, ch)
            assert state is not None, (text[:j], text[j:])
        assert state.done and valid(text) == person


BASE = ('{"name": "Bo", "age": 3, "colour": "red", "level": 2, "home": {"city": "x"}, "flag": true, '
        '"past": [], "note": null')


@pytest.mark.parametrize("tail", [
    ', "colour"', ', "tree": {"label": "a", "children": [{"label": 1', ', "tree": {"label": "a", "children": [{"x"',
    ', "tag": true', ', "tag": [', ', "tree": "a"', ', "pair": [1', ', "pair": ["red", "x"', ', "pair": ["red", 1, 2',
    ', "past": [{"city": "abcdefg', ', "past": [{"zip": 1.5',
    ', "past": [{"city": "a", "zip": "1', ', "flag": f', ', "tree": {"label": "a", "children": [{"label": "b", "c"'])
def test_what_the_schema_forbids_is_refused(tail):
    assert schema_advance(start(SCHEMA), BASE + tail) is None


@pytest.mark.parametrize("field,bad", [("colour", '"blue"'), ("level", "4"), ("level", "300"), ("level", "3,"),
                                       ("flag", "false"), ("note", "3"), ("age", "121")])
def test_enums_consts_and_bounds_refuse_other_values(field, bad):
    fields = json.loads(BASE + "}")
    good = fields.pop(field)
    text = json.dumps(fields)[:-1] + f', "{field}": '
    assert schema_advance(start(SCHEMA), text + json.dumps(good)).done is False  # the valid value gets through
    assert schema_advance(start(SCHEMA), text + bad) is None
    with pytest.raises(ValidationError):
        Person.model_validate_json(text + bad.rstrip(",") + "}")


def test_allof_parts_and_a_refs_siblings_merge():
    schema = {"$defs": {"Base": {"type": "object", "properties": {"id": {"type": "integer", "maximum": 50}},
                                 "required": ["id"]}},
              "allOf": [{"$ref": "#/$defs/Base"}, {"properties": {"id": {"type": "integer", "maximum": 50},
                                                                  "n": {"type": "integer"}}, "required": ["n"]}],
              "properties": {"id": {"type": "integer", "maximum": 50}}, "additionalProperties": False}
    assert schema_advance(start(schema), '{"id": 50, "n": -1}').done
    for text in ('{"id": 51', '{"id": 1}', '{"n": 1}', '{"id": 1, "n": 2, "x"'):
        state = schema_advance(start(schema), text)
        assert state is None or not state.done, text
    tight = {"type": "object", "properties": {"s": {"allOf": [{"maxLength": 4}, {"maxLength": 2}], "type": "string"}}}
    assert schema_advance(start(tight), '{"s": "ab"}').done and schema_advance(start(tight), '{"s": "abc') is None


def test_prefix_items_give_each_leading_item_its_schema():
    closed = {"type": "object", "properties": {"t": {"prefixItems": [{"type": "integer"}, {"enum": ["a"]}],
                                                     "items": False}}}
    assert schema_advance(start(closed), '{"t": [1, "a"]}').done and schema_advance(start(closed), '{"t": [1]}').done
    for text in ('{"t": ["a"', '{"t": [1, 2', '{"t": [1, "a",'):
        assert schema_advance(start(closed), text) is None, text
    rest = {"type": "object", "properties": {"t": {"prefixItems": [{"type": "integer"}], "items": {"type": "boolean"}}}}
    assert schema_advance(start(rest), '{"t": [1, true, false]}').done
    assert schema_advance(start(rest), '{"t": [1, true, 3') is None


def test_ambiguous_alternatives_stay_bounded():
    item = {"anyOf": [{"type": "string"}, {"type": "string", "maxLength": 3}, {"type": "string", "minLength": 1},
                      {"enum": ["ab", "abc", 7]}]}
    schema = {"type": "object", "properties": {"xs": {"type": "array", "items": item}}}
    state = start(schema)
    for piece in ['{"xs": ['] + ['"ab", '] * 60 + ['7, "abcdef"]}']:
        state = schema_advance(state, piece)
        assert state is not None and len(state.states) <= MAX_BRANCHES
    assert state.done


def test_oneof_is_followed_as_anyof_and_oneof_beside_anyof_is_refused():
    schema = {"type": "object", "properties": {"v": {"oneOf": [{"type": "integer"}, {"type": "boolean"}]}}}
    assert schema_advance(start(schema), '{"v": true}').done and schema_advance(start(schema), '{"v": "') is None
    both = {"type": "object", "properties": {"v": {"oneOf": [{"type": "integer"}], "anyOf": [{"type": "integer"}]}}}
    with pytest.raises(InvalidParameterError, match="both anyOf and oneOf"):
        SamplingParams(response_format="json_schema", json_schema=both).validate()


def test_rebase_points_references_into_the_larger_schema():
    params = rebase(SCHEMA, "#/properties/arguments")
    assert params["properties"]["home"]["$ref"] == "#/properties/arguments/$defs/Address"
    assert SCHEMA["properties"]["home"]["$ref"] == "#/$defs/Address"  # the original is left alone
    from kvtool.serving.chat import call_schema

    tool = {"type": "function", "function": {"name": "save", "parameters": SCHEMA}}
    wrapped = call_schema([tool], "save")
    assert wrapped is not None
    person = random_person(random.Random(5))
    call = json.dumps({"name": "save", "arguments": person.model_dump(mode="json")})
    assert schema_advance(start(wrapped), call).done
    assert schema_advance(start(wrapped), call.replace('"colour": "', '"colour": "x')) is None


class Country(str, Enum):
    france = "France"
    germany = "Germany"
    italy = "Italy"


class Neighbour(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=20)
    km: int = Field(ge=0, le=2000)


class City(BaseModel):
    """A Pydantic model with a string enum and a list of another model ($ref), Optional (anyOf), Literal and a
    tuple (prefixItems)."""
    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=20)
    country: Country
    population: Optional[int] = Field(ge=0)
    size: Literal[1, 2, 3]
    neighbours: list[Neighbour] = Field(max_length=2)
    coords: tuple[float, float]
    ratings: dict[str, int] = Field(min_length=1, max_length=2)


def pydantic_valid(model, text: str) -> bool:
    try:
        model.model_validate_json(text)
        return True
    except ValidationError:
        return False


@pytest.mark.real_model
def test_smollm2_fills_a_pydantic_models_schema(smollm2):
    from kvtool.engine import Engine

    engine = Engine(smollm2)
    prompt = smollm2.encode(smollm2.render([{"role": "user", "content": "Describe Paris and two cities near it "
                                                                        "as JSON."}]))
    for fmt, schema in (("json_object", None), ("json_schema", City.model_json_schema())):
        params = [SamplingParams(temperature=0, max_tokens=150, response_format=fmt, json_schema=schema)] + [
            SamplingParams(temperature=0.8, seed=s, max_tokens=150, response_format=fmt, json_schema=schema)
            for s in range(3)]
        texts = [gen.text for gen in engine.generate_batch([prompt] * len(params), params)]
        if schema is None:  # free JSON: keys of its own (city_name, district, ...), no City
            assert not any(pydantic_valid(City, t) for t in texts), texts
        else:
            assert all(pydantic_valid(City, t) for t in texts), texts
