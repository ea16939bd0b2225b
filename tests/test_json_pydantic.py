"""Pydantic models' schemas go through as they come: $defs and references, enums, Optional (anyOf), Literal,
tuples (prefixItems), dicts with bounds; and a tool's references still resolve inside a forced call's schema."""

import json
from enum import Enum
from typing import Literal, Optional

import pytest
from pydantic import BaseModel, ConfigDict, Field

from kvtool import SamplingParams


class Country(str, Enum):
    france = "France"
    germany = "Germany"
    italy = "Italy"


class Neighbour(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=20)
    km: int = Field(ge=0, le=2000)


class City(BaseModel):
    """A string enum and a list of another model ($ref), Optional (anyOf), Literal, a tuple (prefixItems), a dict."""
    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=20)
    country: Country
    population: Optional[int] = Field(ge=0)
    size: Literal[1, 2, 3]
    neighbours: list[Neighbour] = Field(max_length=2)
    coords: tuple[float, float]
    ratings: dict[str, int] = Field(min_length=1, max_length=2)


def test_a_pydantic_schema_compiles_and_a_tools_references_are_rebased_into_the_call():
    from kvtool.serving.chat import call_schema

    schema = City.model_json_schema()
    SamplingParams(response_format="json_schema", json_schema=schema).validate()
    wrapped = call_schema([{"type": "function", "function": {"name": "save", "parameters": schema}}], "save")
    assert wrapped is not None and schema["properties"]["neighbours"]["items"]["$ref"] == "#/$defs/Neighbour"
    assert wrapped["properties"]["arguments"]["properties"]["neighbours"]["items"]["$ref"] == \
        "#/properties/arguments/$defs/Neighbour"
    SamplingParams(response_format="json_schema", json_schema=wrapped, json_suffix="\n</tool_call>").validate()


@pytest.mark.real_model
def test_smollm2_fills_a_pydantic_model(smollm2):
    from kvtool.engine import Engine

    engine = Engine(smollm2)
    prompt = smollm2.encode_chat([{"role": "user", "content": "Describe Paris as JSON."}])
    gen = engine.generate(prompt, SamplingParams(temperature=0, max_tokens=150, response_format="json_schema",
                                                 json_schema=City.model_json_schema())).run()
    assert gen.finish_reason == "stop", gen.text
    City.model_validate(json.loads(gen.text))
