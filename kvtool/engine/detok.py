"""Incremental detokenization and stop-string handling for streaming."""

from __future__ import annotations

import weakref

# tokenizer -> {(token, skip_special_tokens): text}. Streaming decodes single tokens again and again (each
# token's piece, and the one-token prefix of the next step), and a tokenizer call costs ~5 us of Python.
_PIECES: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()


def decode_piece(tokenizer, token: int, skip_special_tokens: bool = False) -> str:
    """tokenizer.decode([token]), memoised per tokenizer."""
    try:
        cache = _PIECES.setdefault(tokenizer, {})
    except TypeError:  # not weak-referenceable: decode every time
        return tokenizer.decode([token], skip_special_tokens=skip_special_tokens)
    key = (token, skip_special_tokens)
    text = cache.get(key)
    if text is None:
        text = cache[key] = tokenizer.decode([token], skip_special_tokens=skip_special_tokens)
    return text


class IncrementalDetokenizer:
    """Turns token ids into text deltas without splitting multi-byte characters.

    Decodes a small window (prefix_offset..end) each step; a delta is released only when
    it does not end in U+FFFD (a partial UTF-8 sequence).
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        if len(ids) == 1:
            return decode_piece(self.tokenizer, ids[0], self.skip)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def add(self, token: int) -> str:
        self.ids.append(token)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix) :]
        return ""

    def flush(self) -> str:
        """Whatever is held back at the end of generation (e.g. a dangling byte)."""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix) :]


class StopStringMatcher:
    """Holds back text that could be the start of a stop string; cuts at a full match."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.text = ""  # everything generated so far (visible text)
        self.emitted = 0
        self.stopped = False

    def feed(self, delta: str) -> str:
        """Add text; return what is now safe to show. Sets .stopped on a match."""
        if self.stopped:
            return ""
        start = max(0, len(self.text) - max((len(s) for s in self.stops), default=0))
        self.text += delta
        if self.stops:
            hits = [i for s in self.stops if (i := self.text.find(s, start)) >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.stopped = True
                return self._release(len(self.text))
        return self._release(len(self.text) - self._pending())

    def finish(self) -> str:
        return self._release(len(self.text))

    def _pending(self) -> int:
        """Length of the longest text suffix that is a proper prefix of a stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best

    def _release(self, upto: int) -> str:
        out = self.text[self.emitted : upto]
        self.emitted = max(self.emitted, upto)
        return out
