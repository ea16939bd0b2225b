"""Regex mode (vLLM's structured_outputs.regex, formerly guided_regex): the whole output matches a pattern.

The constraint has ChoiceConstraint's interface. A token is allowed when the text so far plus its piece
can still be extended to a full match (the `regex` package's partial matching); the end of the turn is
allowed once the text is a full match, and is the only thing allowed when no token's first character
continues it (checked over the vocabulary's first characters, common ASCII first). Special tokens never
spell the output; a character split across tokens is checked as U+FFFD per piece.
"""

from __future__ import annotations

import string
from typing import Iterable

import regex

_FIRST_CHARS: dict[int, tuple[list, str]] = {}  # id(pieces) -> (pieces, their first characters, ASCII first)


def first_chars(pieces: list[str], special: set[int]) -> str:
    """Every character a non-special piece starts with, printable ASCII first; computed once per vocabulary."""
    cached = _FIRST_CHARS.get(id(pieces))
    if cached is None or cached[0] is not pieces:
        chars = {p[0] for i, p in enumerate(pieces) if p and i not in special}
        common = [c for c in string.printable if c in chars]
        cached = _FIRST_CHARS[id(pieces)] = (pieces, "".join(common) + "".join(sorted(chars - set(common))))
    return cached[1]


class RegexConstraint:
    def __init__(self, pieces: list[str], special_ids: Iterable[int], stop_ids: Iterable[int], pattern: str):
        self.pieces, self.special, self.stops = pieces, set(special_ids), set(stop_ids)
        if not self.stops:
            raise ValueError("regex mode needs an end-of-turn token to end the output after a match; this model "
                             "and request have none (give stop_token_ids)")
        self.pattern = regex.compile(pattern)
        self.chars = first_chars(pieces, self.special)
        self.state = ""  # the text so far

    def _continues(self, text: str) -> bool:
        return self.pattern.fullmatch(text, partial=True) is not None

    @property
    def finished(self) -> bool:
        """The text is a full match that no token can continue: only the end of the turn may follow."""
        if self.pattern.fullmatch(self.state) is None:
            return False
        return not any(self._continues(self.state + c) for c in self.chars)

    def next_state(self, token: int) -> str | None:
        """The text after token, or None when it is not allowed now."""
        if token in self.stops:
            return self.state if self.pattern.fullmatch(self.state) is not None else None
        if token >= len(self.pieces) or token in self.special or not self.pieces[token]:
            return None
        text = self.state + self.pieces[token]
        return text if self._continues(text) else None

    def accept(self, token: int) -> None:
        state = self.next_state(token)
        if state is None:
            raise ValueError(f"token {token} ({self.pieces[token]!r}) does not continue a match of the pattern")
        self.state = state
