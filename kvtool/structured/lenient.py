"""Lenient compilation of a JSON schema: enforce what llguidance can, and say, by keyword, what it did not.

A request without `strict` compiles its schema with llguidance's lenient options (LENIENT, the schema's
`x-guidance`): a keyword llguidance does not implement (`uniqueItems`, `not`, draft-7 `dependencies`, `if`/`then`,
`propertyNames`) is left out instead of refused, a `oneOf` whose alternatives may overlap is enforced as `anyOf`,
and `minProperties`/`maxProperties` beside optional properties are left out. llguidance says so in its compile
warnings; unenforced() turns them into Unenforced keywords, each with the paths where the schema uses it. A
`pattern` whose regex llguidance cannot parse (look-around, backreferences) is dropped before the compile
(without_bad_patterns) and reported the same way. An unknown `format` is an annotation, as JSON Schema says, with
or without strict (kvtool.structured.grammar drops it), so it is not reported. A warning this module cannot trace
to a keyword is a refusal: nothing is left out without being named.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass

from llguidance import LLMatcher

from kvtool.errors import InvalidParameterError
from kvtool.structured.schema import subschemas, where, without

LENIENT = {"lenient": True, "coerce_one_of": True}  # llguidance's JSON compile options for a schema without strict
STRICT = {"lenient": False, "coerce_one_of": False}  # with strict: whatever the schema's own x-guidance says
UNIMPLEMENTED = re.compile(r"Unimplemented keys: (\[[^\]]*\])")
UNKNOWN_FORMAT = re.compile(r"Unknown format: (\S+)")
ONE_OF = "oneOf not fully supported"  # llguidance: an overlapping oneOf, compiled as anyOf
ONE_OF_STRICT = "oneOf constraints are not supported"  # llguidance without coerce_one_of: an overlapping oneOf
PROPERTY_COUNT = "min/maxProperties only supported"  # llguidance: a property count beside optional properties
NO_TOKENIZER = "no tokenizer - can't validate"  # a suffix's special token, checked only once a model's tokenizer is


@dataclass(frozen=True)
class Unenforced:
    """A keyword of the schema the grammar does not enforce, and the paths of the subschemas that use it."""

    keyword: str
    paths: tuple[str, ...]

    def __str__(self) -> str:
        shown = ", ".join(self.paths[:3]) + (f" and {len(self.paths) - 3} more" if len(self.paths) > 3 else "")
        return f"{self.keyword} ({shown})" if shown else self.keyword


def keywords_of(warning: str, schema) -> list[str] | None:
    """The keywords one compile warning (or strict compile error) is about: [] for an unknown format (an
    annotation) and a token reference checked without a tokenizer, None for a message not known here."""
    unimplemented = UNIMPLEMENTED.search(warning)
    if unimplemented:
        return json.loads(unimplemented.group(1))
    if warning.startswith(ONE_OF) or ONE_OF_STRICT in warning:
        return ["oneOf"]
    if warning.startswith(PROPERTY_COUNT):
        return [k for k in ("minProperties", "maxProperties") if where(schema, k)]
    return [] if UNKNOWN_FORMAT.match(warning) or warning.startswith(NO_TOKENIZER) else None


def unenforced(schema, warnings, bad_patterns: tuple[str, ...] = ()) -> tuple[Unenforced, ...]:
    """What a lenient compile of schema left out, from its warnings; bad_patterns: the paths of the patterns
    without_bad_patterns dropped. InvalidParameterError for a warning that names no keyword known here."""
    found = [Unenforced("pattern", bad_patterns)] if bad_patterns else []
    for warning in warnings:
        names = keywords_of(warning, schema)
        if names is None:
            raise InvalidParameterError("the JSON schema cannot be enforced: the compiler leaves something out that "
                                        f"structured output cannot name ({warning.splitlines()[0][:200]})")
        found += [Unenforced(name, tuple(where(schema, name))) for name in names
                  if all(u.keyword != name for u in found)]
    return tuple(found)


@functools.lru_cache(maxsize=256)
def parses(pattern: str) -> bool:
    """Whether llguidance's regex syntax takes pattern (no look-around, no backreferences)."""
    return not LLMatcher.validate_grammar(LLMatcher.grammar_from_regex(pattern))


def without_bad_patterns(schema) -> tuple[object, tuple[str, ...]]:
    """(schema without the string patterns llguidance cannot parse, the paths of those patterns)."""
    bad = tuple(path for path, node in subschemas(schema)
                if isinstance(node.get("pattern"), str) and not parses(node["pattern"]))
    if not bad:
        return schema, ()
    return without(schema, lambda k, v: k == "pattern" and isinstance(v, str) and not parses(v)), bad
