"""Skill preamble specs (kvtool.skills.preamble): parsing and refusals; no model needed."""

import pytest

from kvtool.errors import InvalidParameterError
from kvtool.skill_settings import DEEP_TOKENS, canonical_preamble, parse_preamble
from kvtool.skills.preamble import context_text


def test_parse_and_canonical_spelling():
    assert parse_preamble("conversation") == ("conversation", 0) and parse_preamble("none") == ("none", 0)
    assert parse_preamble("deep") == ("deep", DEEP_TOKENS) and parse_preamble("deep:tokens=512") == ("deep", 512)
    deep = f"deep:tokens={DEEP_TOKENS}"
    assert canonical_preamble("deep") == deep == canonical_preamble(deep)
    assert canonical_preamble("none") == "none"
    assert len(context_text().split()) > 500  # the generic instructions ship with the package


@pytest.mark.parametrize("spec, why", [("deeper", "unknown skill preamble"), ("none:tokens=3", "takes no knobs"),
                                       ("deep:tokens=0", "tokens=N with N >= 1"), ("deep:depth=9", "the knob is"),
                                       ("deep:tokens=x", "the knob is")])
def test_bad_specs_are_refused_by_name(spec, why):
    with pytest.raises(InvalidParameterError, match=why):
        parse_preamble(spec)
