"""JSON mode (response_format json_object, json_schema): every sampled token keeps the output a prefix of one
JSON object (of the schema's shape, with kvtool.structured.json_schema).

JsonConstraint checks candidate tokens by their text pieces, most likely first, against the grammar
state of kvtool.structured.json_syntax, and ends the output with an end-of-turn token once the object is
closed. A piece that decodes alone to U+FFFD (part of a multi-byte character) is allowed inside strings
only. Special tokens other than the end of turn are never allowed.
"""

from __future__ import annotations

from typing import Iterable

from kvtool.structured.json_schema import schema_advance, start
from kvtool.structured.json_syntax import MAX_NUMBER, MAX_WS, JsonState, advance

__all__ = ["JsonConstraint", "JsonState", "advance", "MAX_NUMBER", "MAX_WS"]


class JsonConstraint:
    """Per request: which token may come next so the output stays a prefix of one JSON object."""

    def __init__(self, pieces: list[str], special_ids: Iterable[int], stop_ids: Iterable[int], schema: dict | None = None,
                 suffix: str = ""):
        """schema: a JSON schema the object must also follow (kvtool.structured.json_schema); None: any object.
        suffix: text that must follow the object before the turn ends (a tool call's closing tag)."""
        self.pieces, self.special, self.stops = pieces, set(special_ids), set(stop_ids)
        self.suffix = suffix  # what of it is still to come, once the object is closed
        if not self.stops:
            raise ValueError("JSON mode needs an end-of-turn token to end the object after it closes; this model "
                             "and request have none (give stop_token_ids)")
        if schema is None:
            self.state, self._advance = JsonState(), advance
        else:
            self.state, self._advance = start(schema), schema_advance

    @property
    def finished(self) -> bool:
        """The object and its suffix are out: only the end of the turn may follow."""
        return self.state.done and not self.suffix

    def next_state(self, token: int) -> JsonState | None:
        """The state after token, or None when it is not allowed now."""
        if token in self.stops:
            return self.state if self.finished else None
        if token >= len(self.pieces) or self.finished:
            return None
        piece = self.pieces[token]
        if self.state.done:  # spelling the suffix: any piece that is a start of what is left
            return self.state if piece and self.suffix.startswith(piece) else None
        if token in self.special:
            return None
        return self._advance(self.state, piece) if piece else None

    def accept(self, token: int) -> None:
        state = self.next_state(token)
        if state is None:
            raise ValueError(f"token {token} ({self.pieces[token]!r}) does not continue the JSON output")
        if self.state.done and token not in self.stops:
            self.suffix = self.suffix[len(self.pieces[token]):]
        self.state = state
