"""JSON schema mode on single values: number bounds (against brute force), string patterns and formats
(random walks validated by the standard library's parsers), and SmolLM2 filling dates, codes and a
probability that it writes wrongly when left free."""

from __future__ import annotations

import datetime
import ipaddress
import itertools
import json
import random
import re
import uuid

import jsonschema
import pytest
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvtool import SamplingParams
from kvtool.errors import InvalidParameterError
from kvtool.structured.json_schema import schema_advance, start
from kvtool.structured.schema_values import number_ok
from tests.test_json_schema import random_walk


def decimals(int_digits: int, frac_digits: int) -> list[str]:
    """Every JSON decimal (no exponent) with up to that many digits each side of the point, both signs."""
    wholes = ["0"] + [str(n) for n in range(1, 10 ** int_digits)]
    fracs = [""] + ["".join(d) for k in range(1, frac_digits + 1) for d in itertools.product("0123456789", repeat=k)]
    return [f"{sign}{w}{'.' + f if f else ''}" for sign in ("", "-") for w in wholes for f in fracs]


def test_number_prefixes_are_allowed_exactly_when_a_decimal_in_range_starts_with_them():
    rng = random.Random(0)
    complete = [(t, float(t)) for t in decimals(2, 3)]
    prefixes = sorted({t[:i] for t in decimals(1, 2) for i in range(1, len(t) + 1)})
    grid = [n / 10 for n in range(-99, 100, 3)]
    for _ in range(6):
        node = {"type": "number"}
        for name in rng.sample(["minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum"], rng.randrange(1, 3)):
            node[name] = rng.choice(grid)
        get = node.get
        inside = [t for t, v in complete if v >= get("minimum", -1e9) and v > get("exclusiveMinimum", -1e9)
                  and v <= get("maximum", 1e9) and v < get("exclusiveMaximum", 1e9)]
        for t, _ in complete[::101]:
            assert number_ok(node, t, True) == (t in inside), (node, t)
        reachable = {t[:i] for t in inside for i in range(1, len(t) + 1)}
        for prefix in prefixes:  # bounds on a 0.1 grid: a prefix that can reach the range does so within 2+3 digits
            assert number_ok(node, prefix, False) == (prefix in reachable), (node, prefix)


VALUES = {"type": "object", "properties": {
    "day": {"type": "string", "format": "date"}, "at": {"type": "string", "format": "date-time"},
    "id": {"type": "string", "format": "uuid"}, "ip": {"type": "string", "format": "ipv4"},
    "mail": {"type": "string", "format": "email"}, "code": {"type": "string", "pattern": "^[A-Z]{2}-\\d{3}$"},
    "has": {"type": "string", "pattern": "[0-9]"}, "p": {"type": "number", "minimum": 0, "maximum": 1},
    "t": {"type": "number", "exclusiveMinimum": -40.5, "exclusiveMaximum": -40}},
    "additionalProperties": False}
PIECES = list('{}",: 0123456789-.eETZ@+:') + list("abcdefghijklmnopqrstuvwxyzAB") + [
    f'"{k}"' for k in VALUES["properties"]] + ["2024-", "12-31", "\\u0041", ".com", "ab"]


def check_values(obj: dict) -> None:
    jsonschema.validate(obj, VALUES)
    for key, parse in (("day", datetime.date.fromisoformat), ("at", datetime.datetime.fromisoformat),
                       ("id", uuid.UUID), ("ip", ipaddress.IPv4Address)):
        if key in obj:
            parse(obj[key])
    if "mail" in obj:
        assert re.fullmatch(r"[^@\s]+@[^@\s]+\.[^@\s]+", obj["mail"]), obj["mail"]


def test_random_walks_end_only_in_values_that_parse():
    rng = random.Random(1)
    for _ in range(200):
        check_values(json.loads(random_walk(VALUES, rng, 400, '}"', PIECES)))


def test_valid_values_pass_character_by_character():
    rng = random.Random(2)
    for _ in range(200):
        obj = {"day": rng.choice(["2024-02-29", "1999-12-31"]), "at": rng.choice(["2024-01-01T10:00:00Z",
                                                                                 "2024-01-01T23:59:59.123+02:00"]),
               "id": str(uuid.UUID(int=rng.getrandbits(128))), "ip": rng.choice(["0.0.0.0", "255.10.1.99"]),
               "mail": rng.choice(["a@b.co", "first.last+x@mail.example.org"]), "code": "AB-123",
               "has": rng.choice(["7", "xx1yy", "ab\\u0033"]), "p": rng.choice([0, 1, 0.5, 0.999, 1.0]),
               "t": rng.choice([-40.1, -40.499, -40.0001])}
        obj = {k: v for k, v in obj.items() if rng.random() < 0.8}
        text = json.dumps(obj).replace("\\\\u0033", "\\u0033")  # an escaped digit
        state = schema_advance(start(VALUES), text)
        assert state is not None and state.done, text


@pytest.mark.parametrize("text", ['{"day": "2024-13', '{"day": "2024-1-1', '{"day": "24th', '{"code": "AB-12"',
                                  '{"code": "ab', '{"has": "xyz"}', '{"has": "ab\\u0041"}', '{"id": "123g',
                                  '{"ip": "256', '{"mail": "a@"',
                                  '{"p": 1.5', '{"p": -0.1', '{"p": 2', '{"p": 1e', '{"t": -40}', '{"t": -40.5}',
                                  '{"t": -41', '{"at": "2024-01-01 10', '{"code": "A\\u0042-12"'])
def test_what_the_values_forbid_is_refused(text):
    assert schema_advance(start(VALUES), text) is None


def test_bad_patterns_and_empty_ranges_are_refused_by_name():
    for node, words in (({"type": "string", "pattern": "(ab"}, "is not a valid regular expression"),
                        ({"type": "string", "pattern": 5}, "pattern must be a string"),
                        ({"type": "number", "minimum": 1, "exclusiveMaximum": 1}, "leaves no number")):
        with pytest.raises(InvalidParameterError, match=words):
            SamplingParams(response_format="json_schema",
                           json_schema={"type": "object", "properties": {"a": node}}).validate()


class Booking(BaseModel):
    model_config = ConfigDict(extra="forbid")
    guest: str = Field(max_length=20)
    day: datetime.date
    postcode: str = Field(pattern=r"^\d{5}$")
    confidence: float = Field(ge=0, le=1)


@pytest.mark.real_model
def test_smollm2_writes_dates_codes_and_probabilities_that_validate(smollm2):
    from kvtool.engine import Engine

    schema = Booking.model_json_schema()
    loose = json.loads(json.dumps(schema))
    for key in ("day", "postcode", "confidence"):
        loose["properties"][key] = {"type": schema["properties"][key]["type"]}
    engine = Engine(smollm2)
    ask = "Book a hotel room in Paris for Anna next Friday, as JSON. Say how confident you are."
    prompt = smollm2.encode(smollm2.render([{"role": "user", "content": ask}]))
    for which in (loose, schema):
        params = [SamplingParams(temperature=0, max_tokens=100, response_format="json_schema", json_schema=which)] + [
            SamplingParams(temperature=0.8, seed=s, max_tokens=100, response_format="json_schema", json_schema=which)
            for s in range(3)]
        valid = []
        for gen in engine.generate_batch([prompt] * len(params), params):
            try:
                Booking.model_validate_json(gen.text)
                valid.append(True)
            except ValidationError:
                valid.append(False)
        # free: postcode "FR", confidence 100, day "24th of July, 2023"; bounded: all four validate
        assert valid == ([False] * 4 if which is loose else [True] * 4), valid
