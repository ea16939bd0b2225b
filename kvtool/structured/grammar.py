"""Request fields -> one llguidance grammar: a JSON schema (or any JSON object), a regex, a list of choices, or a
Lark / GBNF grammar, each followed by an optional suffix (a tool call's closing tag).

llguidance compiles the grammar and its matcher computes, per step, which tokens may come next
(kvtool.engine.constraint). Here it is text only (no tokenizer, no torch), so config checks a request's
schema, pattern or grammar with the same compiler before any model runs: a schema or grammar it cannot
compile is refused with llguidance's message, led for a schema by where the keyword or `$ref` it names is
(`schema.properties.a uses not`).

JSON is written compactly with one space after ':' and ',' (no free whitespace, which a small model can spend
its whole max_tokens on). A `format` the compiler does not know is an annotation, as JSON Schema says of
unknown formats, and is dropped before compiling. With strict, every other keyword it does not implement is an
error; without, the schema is compiled leniently (kvtool.structured.lenient) and json_compiled says which keywords
the grammar leaves unenforced.
"""

from __future__ import annotations

import copy
import functools
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass

from llguidance import LLMatcher, grammar_from

from kvtool.errors import InvalidParameterError
from kvtool.structured.lenient import LENIENT, STRICT, UNKNOWN_FORMAT, Unenforced, keywords_of, unenforced
from kvtool.structured.lenient import without_bad_patterns
from kvtool.structured.schema import subschemas, where, without

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT = {"type": "object"}
MISSING_REF = re.compile(r"(Pointer|Resource) '([^']*)' (does not exist|is not present)")
Ranges = tuple[tuple[int, int], ...]  # inclusive code point ranges
WITHOUT_STRICT = "; without strict, the rest of the schema is enforced and the keyword reported"


@dataclass(frozen=True)
class JsonGrammar:
    grammar: str
    lark: str  # the same grammar as Lark text (llguidance's dialect), for another engine's llguidance
    unenforced: tuple[Unenforced, ...] = ()  # without strict: the schema's keywords the grammar leaves out


def json_grammar(schema: dict | bool | None, suffix: str = "", specials: Mapping[str, int] | None = None,
                 strict: bool = True) -> str:
    """The grammar of one JSON value of `schema` (None: any JSON object), then `suffix` (see suffix_lark)."""
    return json_compiled(schema, suffix, specials, strict).grammar


def json_compiled(schema: dict | bool | None, suffix: str = "", specials: Mapping[str, int] | None = None,
                  strict: bool = True) -> JsonGrammar:
    """json_grammar's grammar, and without strict what it leaves unenforced; with strict, InvalidParameterError
    for anything it could not enforce, naming the keyword and where it is."""
    schema = ANY_OBJECT if schema is None else {} if schema is True else schema
    if schema is False:
        raise InvalidParameterError("the JSON schema is false: no value matches it")
    check_meta(schema)
    schema, bad_patterns = (schema, ()) if strict else without_bad_patterns(schema)
    for _ in range(8):  # each pass drops one unknown format
        grammar = _json_then(schema, suffix, specials or {}, strict)
        error, warnings = compile_messages(grammar)
        unknown = UNKNOWN_FORMAT.search(error)
        if not unknown:
            break
        schema = without(schema, lambda k, v, name=unknown.group(1): k == "format" and v == name)
    if error:
        raise InvalidParameterError(f"the JSON schema cannot be enforced: {explain(schema, error)}")
    return JsonGrammar(grammar, json_lark(schema, suffix, specials or {}, strict),
                       () if strict else unenforced(schema, warnings, bad_patterns))


def unenforced_keywords(schema, suffix: str = "") -> tuple[Unenforced, ...]:
    """json_compiled(schema, suffix, strict=False).unenforced, remembered by the schema's text: a response reads it
    for its header, its timings and the log."""
    return _unenforced(json.dumps(schema, sort_keys=True), suffix)


@functools.lru_cache(maxsize=64)
def _unenforced(schema_text: str, suffix: str) -> tuple[Unenforced, ...]:
    return json_compiled(json.loads(schema_text), suffix, strict=False).unenforced


def explain(schema, error: str) -> str:
    """The compiler's error, led by where in schema the keyword or $ref it names is."""
    reason = first_lines(error)
    for name in keywords_of(error, schema) or ():
        paths = where(schema, name)
        if paths:
            return f"{paths[0]} uses {name}, which structured output does not implement ({reason}){WITHOUT_STRICT}"
    bad_patterns = without_bad_patterns(schema)[1] if "regex parse error" in error else ()
    if bad_patterns:
        return f"{bad_patterns[0]}.pattern is a regex structured output cannot parse ({reason}){WITHOUT_STRICT}"
    ref = MISSING_REF.search(error)
    if ref:
        target = ref.group(2)
        for path, node in subschemas(schema):
            value = node.get("$ref")
            if isinstance(value, str) and value in (target, "#" + target):
                return f"{path}.$ref {value!r} points to nothing in the schema ({reason})"
    return reason


def check_meta(schema: dict) -> None:
    """InvalidParameterError when schema breaks its draft's metaschema (a keyword of the wrong type), with its path."""
    from jsonschema import Draft202012Validator, SchemaError, validators

    try:
        validators.validator_for(schema, default=Draft202012Validator).check_schema(schema)
    except SchemaError as exc:
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in exc.path)
        raise InvalidParameterError(f"the JSON schema cannot be enforced: schema{where} is invalid: "
                                    f"{exc.message[:300]}") from None


def _json_then(schema, suffix: str, specials: Mapping[str, int], strict: bool = True) -> str:
    if not suffix:
        return LLMatcher.grammar_from_json_schema(schema, overrides={**JSON_OPTIONS, **(STRICT if strict else LENIENT)})
    return LLMatcher.grammar_from_lark(json_lark(schema, suffix, specials, strict))


def json_lark(schema, suffix: str, specials: Mapping[str, int], strict: bool = True) -> str:
    """Lark text of one JSON value of schema, compiled with kvtool's options (its `x-guidance`), then suffix."""
    body = json.dumps({**schema, "x-guidance": {**JSON_OPTIONS, **(STRICT if strict else LENIENT)}})
    return f"start: value {suffix_lark(suffix, specials)}\nvalue: %json {body}\n" if suffix else \
        f"start: %json {body}\n"


def suffix_lark(suffix: str, specials: Mapping[str, int]) -> str:
    """suffix as a Lark sequence: its text as string literals, and each special token of the model in it
    (`specials`: text -> id, e.g. Qwen2.5's `</tool_call>`) as that token, `<[id]>`.

    A model writes a special token as its one id, never as the text's bytes, which the grammar would otherwise
    ask for; where the tag is plain text in a vocabulary (SmolLM2, Gemma 3), it is not in specials."""
    return " ".join(f"<[{p}]>" if isinstance(p, int) else json.dumps(p) for p in suffix_parts(suffix, specials))


def suffix_parts(suffix: str, specials: Mapping[str, int]) -> list[str | int]:
    """suffix split, in order, into its text and the special tokens of the model in it (as their ids)."""
    names = sorted((n for n in specials if n and n in suffix), key=len, reverse=True)
    if not names:
        return [suffix] if suffix else []
    parts = re.split("(" + "|".join(map(re.escape, names)) + ")", suffix)
    return [specials[p] if p in specials else p for p in parts if p]


def unwritable_chars(written: set[int]) -> Ranges:
    """The code points (inclusive ranges) no text of these tokens can hold: where a vocabulary has no token with
    byte b (SmolLM2 has none with 0x14, nor 0xf1, which starts U+40000-U+7FFFF), no character whose UTF-8 starts
    with b can be written. A missing continuation byte (0x80-0xbf) is not traced to characters."""
    ranges = [(b, b) for b in sorted(set(range(0x80)) - written)]
    for b in sorted(set(range(0xc2, 0xf5)) - written):  # lead bytes of 2-, 3- and 4-byte characters
        width = 6 if b < 0xe0 else 12 if b < 0xf0 else 18  # the bits its continuation bytes carry
        lo = (b & (0x3f >> width // 6)) << width
        hi = 0xd7ff if b == 0xed else min(0x10ffff, lo + (1 << width) - 1)  # past 0xd7ff: surrogates, not text
        ranges.append((lo, hi))
    return tuple(ranges)


def regex_grammar(pattern: str, unwritable: Ranges = ()) -> str:
    """The pattern's grammar; given the characters a model cannot write (code point ranges), only the matches
    free of them: llguidance then never offers a token after which the match needs one (a dead end)."""
    grammar = LLMatcher.grammar_from_regex(pattern)
    top = json.loads(grammar)
    lark = top["grammars"][0]["lark_grammar"]  # start: /pattern/, its slashes escaped
    if not unwritable or not lark.startswith("start: /"):
        return grammar
    banned = "".join(f"\\x{{{lo:x}}}-\\x{{{hi:x}}}" for lo, hi in unwritable)
    top["grammars"][0]["lark_grammar"] = f"start: WRITABLE\nWRITABLE: {lark[7:]} & /[^{banned}]*/"
    return json.dumps(top)


def choice_grammar(choices: list[str], unwritable: Ranges = ()) -> str:
    """The grammar of exactly one of the choices; InvalidParameterError for a choice with a character the model
    cannot write (unwritable: code point ranges)."""
    for i, choice in enumerate(choices):
        bad = next((ch for ch in choice for lo, hi in unwritable if lo <= ord(ch) <= hi), None)
        if bad is not None:
            raise InvalidParameterError(f"choice {i} ({choice[:40]!r}) has the character U+{ord(bad):04X}, which no "
                                        "token of this model spells")
    return grammar_from("choice", choices)


def text_grammar(text: str) -> str:
    """A Lark grammar (llguidance's dialect, `start:` first) or a GBNF grammar (llama.cpp's, `root ::=`)."""
    try:
        return grammar_from("grammar", text)
    except ValueError as exc:
        raise InvalidParameterError(f"the grammar is neither Lark nor GBNF: {exc}") from None


@functools.lru_cache(maxsize=64)
def compile_messages(grammar: str) -> tuple[str, tuple[str, ...]]:
    """llguidance's (complaint about grammar, '' when it compiles; its warnings), remembered: a request's grammar
    is checked when its parameters are validated, again when the server sets the request up, and its warnings
    read for the response."""
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    return (messages[0], ()) if is_error else ("", tuple(messages))


def compile_error(grammar: str) -> str:
    """llguidance's complaint about grammar ('' when it compiles)."""
    return compile_messages(grammar)[0]


def check(grammar: str, what: str) -> str:
    """grammar, once llguidance compiles it; else InvalidParameterError naming `what` and the compiler's reason."""
    error = compile_error(grammar)
    if error:
        raise InvalidParameterError(f"{what} cannot be enforced: {first_lines(error)}")
    return grammar


def first_lines(error: str) -> str:
    """The compiler's message, its first three lines on one line (it may go on with the whole grammar)."""
    return " ".join([ln.strip() for ln in error.strip().splitlines() if ln.strip()][:3])[:600]


def rebase(schema: dict, base: str) -> dict:
    """A copy of schema for use at pointer `base` of a larger one: its '#...' references made to start there."""
    out = copy.deepcopy(schema)
    for _, node in subschemas(out):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            node["$ref"] = base + ref[1:]
    return out


def request_grammar(response_format: str = "text", json_schema=None, json_suffix: str = "", choice=None, regex=None,
                    grammar=None, specials: Mapping[str, int] | None = None, unwritable: Ranges = (),
                    checked: bool = True, strict: bool = True) -> str | None:
    """The grammar a request's structured fields ask for (None: free text), checked: InvalidParameterError names
    the field and what the compiler could not take. specials (the model's special tokens, text -> id) turn those
    tokens in json_suffix into token references; without them the suffix is text (a check needs no model).
    unwritable (the characters no token of the model spells) keeps a regex to the matches the model can write,
    and refuses a choice it cannot. checked=False skips the compile (a matcher built from it reports the same).
    strict=False compiles a JSON schema leniently (json_compiled)."""
    ok = check if checked else lambda text, what: text
    if choice is not None:
        return ok(choice_grammar(choice, unwritable), "choice")
    if regex is not None:
        return ok(regex_grammar(regex, unwritable), f"the regex {regex[:80]!r}")
    if grammar is not None:
        return ok(text_grammar(grammar), "the grammar")
    if response_format == "text":
        return None
    return json_grammar(json_schema, json_suffix, specials, strict)
