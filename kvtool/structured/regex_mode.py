"""Regex mode (vLLM's structured_outputs.regex, formerly guided_regex): the whole output matches a pattern.

The constraint has ChoiceConstraint's interface. A token is allowed when the text so far plus its piece
can still be extended to a full match (the `regex` package's partial matching); the end of the turn is
allowed once the text is a full match, and is the only thing allowed when no token's first character
continues it (checked over the vocabulary's first characters, common ASCII first). Special tokens never
spell the output; a character split across tokens is checked as U+FFFD per piece.

compile_pattern() is the one way a user's pattern is compiled (here and for a JSON schema's `pattern`). It
parses the pattern with the `regex` package's own parser, so every syntax rule (escapes, classes, `{,n}`,
verbose mode, inline flags) is the package's, and refuses, before compiling, what would exhaust time or
memory: a repeat count above MAX_REPEAT in `{m}`, `{m,}` or `{m,n}`, or nested repeats whose counts
multiply past it (`(?:a{100}){100}`); a pattern over MAX_LENGTH characters, or over MAX_SIZE parse nodes
once its repeats are written out (the compiler unrolls them: `a{1000}` times 100 in a row); recursion and
subroutine calls (`(?R)`, `(?0)`, `(?1)`, `(?&name)`, `(?P>name)`), whose partial matching has no bound.
Within these limits a pattern compiles in well under 100 ms (most in under 1 ms). Real patterns fit:
dates, phone numbers, UUIDs, `\\w{1,64}`, `[a-z]{2,1000}`. A match that still takes over MATCH_TIMEOUT
seconds (exponential backtracking, as in `(a|aa)+b`) fails the request with an error instead of stalling
the server.
"""

from __future__ import annotations

import string
from typing import Iterable

import regex
from regex import (
    _regex_core as core,  # the package's own parser: the syntax compile_pattern checks is regex's
)

from kvtool.errors import InvalidParameterError

MAX_REPEAT = 1000  # a counted repeat, or nested ones multiplied: room for [a-z]{2,1000}
MAX_LENGTH = 4000  # characters in a pattern (a long literal run makes partial matching slow: ~n^3)
MAX_SIZE = 10_000  # parse nodes, repeats written out: ~30 ms to compile at worst
MATCH_TIMEOUT = 1.0  # seconds one partial match may take

_FIRST_CHARS: dict[int, tuple[list, str]] = {}  # id(pieces) -> (pieces, their first characters, ASCII first)


def first_chars(pieces: list[str], special: set[int]) -> str:
    """Every character a non-special piece starts with, printable ASCII first; computed once per vocabulary."""
    cached = _FIRST_CHARS.get(id(pieces))
    if cached is None or cached[0] is not pieces:
        chars = {p[0] for i, p in enumerate(pieces) if p and i not in special}
        common = [c for c in string.printable if c in chars]
        cached = _FIRST_CHARS[id(pieces)] = (pieces, "".join(common) + "".join(sorted(chars - set(common))))
    return cached[1]


def timeout_message(what: str) -> str:
    return (f"{what}: matching the output so far took over {MATCH_TIMEOUT} s (the pattern backtracks "
            "exponentially, as (a|aa)+b does); rewrite it so each character can match in fewer ways")


def compile_pattern(pattern: str) -> regex.Pattern:
    """The compiled pattern; InvalidParameterError saying what is wrong with it (the caller names the field)."""
    if len(pattern) > MAX_LENGTH:
        raise InvalidParameterError(f"the pattern is {len(pattern)} characters long, over the limit {MAX_LENGTH}")
    try:
        _size(_parse(pattern), 1)
        return regex.compile(pattern)
    except regex.error as exc:
        raise InvalidParameterError(f"the pattern is not a valid regular expression: {exc}") from None
    except RecursionError:
        raise InvalidParameterError("the pattern nests groups too deeply") from None


def _parse(pattern: str) -> core.RegexBase:
    """The parse tree regex.compile would build (an inline global flag such as (?x) makes it parse again)."""
    flags = 0
    while True:
        source = core.Source(pattern)
        info = core.Info(flags, source.char_type, {})
        source.ignore_space = bool(info.flags & core.VERBOSE)
        try:
            return core._parse_pattern(source, info)
        except core._UnscopedFlagSet:
            flags = info.global_flags


def _size(node, scale: int) -> int:
    """Parse nodes under node with its repeats written out; refuses what the module docstring lists.
    scale: the product of the counts of the repeats around node."""
    if isinstance(node, core.CallGroup):
        raise InvalidParameterError("the pattern uses recursion or a subroutine call ((?R), (?1), (?&name), "
                                    "(?P>name)), under which the output could never be checked; write the "
                                    "repetition out with bounded repeats")
    if isinstance(node, core.SetBase):  # a character class: one node however it is written
        return 1
    count = 1
    if isinstance(node, core.GreedyRepeat):  # lazy and possessive repeats too
        count = max(node.min_count if node.max_count is None else node.max_count, 1)
        if count > MAX_REPEAT:
            raise InvalidParameterError(f"repeat count {count} in the pattern exceeds the limit {MAX_REPEAT}")
        if scale * count > MAX_REPEAT:
            raise InvalidParameterError(f"nested repeats in the pattern multiply to {scale * count}, over the "
                                        f"limit {MAX_REPEAT}; repeat fewer times or unnest them")
    size = 1
    for value in vars(node).values():
        for child in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(child, core.RegexBase):
                size += count * _size(child, scale * count)
    if size > MAX_SIZE:
        raise InvalidParameterError(f"the pattern is too large once its repeats are written out (over {MAX_SIZE} "
                                    "parts); shorten it or repeat less")
    return size


class RegexConstraint:
    def __init__(self, pieces: list[str], special_ids: Iterable[int], stop_ids: Iterable[int], pattern: str):
        self.pieces, self.special, self.stops = pieces, set(special_ids), set(stop_ids)
        if not self.stops:
            raise ValueError("regex mode needs an end-of-turn token to end the output after a match; this model "
                             "and request have none (give stop_token_ids)")
        try:
            self.pattern = compile_pattern(pattern)
        except InvalidParameterError as exc:
            raise InvalidParameterError(f"invalid sampling parameter regex={pattern!r}: {exc}") from None
        self.chars = first_chars(pieces, self.special)
        self.state = ""  # the text so far

    def _matches(self, text: str, partial: bool) -> bool:
        try:
            return self.pattern.fullmatch(text, partial=partial, timeout=MATCH_TIMEOUT) is not None
        except TimeoutError:
            raise InvalidParameterError(timeout_message(f"invalid sampling parameter regex={self.pattern.pattern!r}"))

    def _continues(self, text: str) -> bool:
        return self._matches(text, True)

    @property
    def finished(self) -> bool:
        """The text is a full match that no token can continue: only the end of the turn may follow."""
        if not self._matches(self.state, False):
            return False
        return not any(self._continues(self.state + c) for c in self.chars)

    def next_state(self, token: int) -> str | None:
        """The text after token, or None when it is not allowed now."""
        if token in self.stops:
            return self.state if self._matches(self.state, False) else None
        if token >= len(self.pieces) or token in self.special or not self.pieces[token]:
            return None
        text = self.state + self.pieces[token]
        return text if self._continues(text) else None

    def accept(self, token: int) -> None:
        state = self.next_state(token)
        if state is None:
            raise ValueError(f"token {token} ({self.pieces[token]!r}) does not continue a match of the pattern")
        self.state = state
