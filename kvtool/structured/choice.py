"""Choice mode (vLLM's guided_choice): the output is exactly one of a few given strings.

The constraint has JsonConstraint's interface (finished, stops, next_state, accept), so the sampler
draws under it the same way: a token is allowed when the text so far plus its piece is still the start
of some choice; the end of the turn is allowed once the text is a whole choice, and is the only thing
allowed when no longer choice starts with it. Special tokens never spell a choice.
"""

from __future__ import annotations

from typing import Iterable


class ChoiceConstraint:
    def __init__(self, pieces: list[str], special_ids: Iterable[int], stop_ids: Iterable[int], choices: list[str]):
        self.pieces, self.special, self.stops = pieces, set(special_ids), set(stop_ids)
        self.choices = list(choices)
        if not self.stops:
            raise ValueError("choice mode needs an end-of-turn token to end the output after a choice; this model "
                             "and request have none (give stop_token_ids)")
        self.state = ""  # the text so far

    @property
    def finished(self) -> bool:
        """The text is a whole choice and no longer one starts with it: only the end of the turn may follow."""
        return self.state in self.choices and not any(c != self.state and c.startswith(self.state)
                                                      for c in self.choices)

    def next_state(self, token: int) -> str | None:
        """The text after token, or None when it is not allowed now."""
        if token in self.stops:
            return self.state if self.state in self.choices else None
        if token >= len(self.pieces) or token in self.special or not self.pieces[token]:
            return None
        text = self.state + self.pieces[token]
        return text if any(c.startswith(text) for c in self.choices) else None

    def accept(self, token: int) -> None:
        state = self.next_state(token)
        if state is None:
            raise ValueError(f"token {token} ({self.pieces[token]!r}) does not continue any choice")
        self.state = state
