"""Incremental detokenization and stop-string handling for streaming.

Byte-level BPE tokenizers (GPT-2's scheme: Qwen, SmolLM2, Llama 3) spell every token as bytes, so a
stream is decoded by appending each token's bytes to one incremental UTF-8 decoder: ~1 us a token
instead of a tokenizer call on a window (~5 us). Where the tokenizer is not of that kind, or a check of
its own decode() disagrees, the window decoder (IncrementalDetokenizer's fallback) is used.
"""

from __future__ import annotations

import codecs
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


def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte <-> printable character table, as char -> byte: printable bytes stand for themselves, the
    others (controls, space, 0x7f-0xa0, 0xad) for the characters from U+0100 up, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    rest = [b for b in range(256) if b not in keep]
    return {**{chr(b): b for b in keep}, **{chr(256 + i): b for i, b in enumerate(rest)}}


BYTE_OF_CHAR = _byte_of_char()


class ByteVocab:
    """A byte-level tokenizer's tokens as bytes, looked up as they are met; added tokens as their text."""

    def __init__(self, tokenizer, skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.added = {i: "" if skip_special_tokens and a.special else a.content
                      for i, a in tokenizer.added_tokens_decoder.items()}
        self._bytes: dict[int, bytes] = {}

    def bytes_of(self, token: int) -> bytes:
        b = self._bytes.get(token)
        if b is None:
            piece = self.tokenizer.convert_ids_to_tokens(token)
            b = self._bytes[token] = bytes(BYTE_OF_CHAR[c] for c in piece) if piece else b""
        return b

    @classmethod
    def for_tokenizer(cls, tokenizer, skip_special_tokens: bool) -> "ByteVocab | None":
        """The vocab when the tokenizer is byte-level and its own decode() agrees on a check set, else None."""
        try:
            cache = _VOCABS.setdefault(tokenizer, {})
        except TypeError:
            return None
        if skip_special_tokens not in cache:
            cache[skip_special_tokens] = cls._checked(tokenizer, skip_special_tokens)
        return cache[skip_special_tokens]

    @classmethod
    def _checked(cls, tokenizer, skip: bool) -> "ByteVocab | None":
        try:
            decoder = tokenizer.backend_tokenizer.decoder
            if type(decoder).__name__ != "ByteLevel" or tokenizer.clean_up_tokenization_spaces:
                return None
            vocab = cls(tokenizer, skip)
            n = len(tokenizer)
            ids = sorted({*range(0, n, max(1, n // 400)), *range(min(n, 300)), *vocab.added})
            partial = [t for t in ids if t not in vocab.added and len(vocab.bytes_of(t)) == 1
                       and vocab.bytes_of(t)[0] >= 0x80][:3]
            added = list(vocab.added)[:4] + [t for t, a in vocab.added.items() if a and not a.startswith("<|")][:2]
            seqs = [[t] for t in ids] + [ids[i : i + 7] for i in range(0, len(ids), 7)]
            seqs += [[p, a, p, p] for p in partial for a in added] + [partial + partial]
            stream_ok = all(_stream_text(vocab, s) == tokenizer.decode(s, skip_special_tokens=skip) for s in seqs)
            return vocab if stream_ok else None
        except (KeyError, TypeError, ValueError, AttributeError):  # a character outside the byte table, or no backend
            return None


_VOCABS: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()


class ByteStream:
    """Token ids -> text through one incremental UTF-8 decoder. An added token that shows is a boundary, as in
    the tokenizer's decode(): bytes left dangling before it become U+FFFD, then its text follows."""

    def __init__(self, vocab: ByteVocab):
        self.vocab = vocab
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def add(self, token: int) -> str:
        text = self.vocab.added.get(token)
        if text is None:
            return self.decoder.decode(self.vocab.bytes_of(token))
        if not text:  # a special token, skipped: as if it were not there
            return ""
        return self.flush() + text

    def flush(self) -> str:
        out = self.decoder.decode(b"", final=True)
        self.decoder.reset()
        return out


def _stream_text(vocab: ByteVocab, ids: list[int]) -> str:
    stream = ByteStream(vocab)
    return "".join(stream.add(t) for t in ids) + stream.flush()


class IncrementalDetokenizer:
    """Turns token ids into text deltas without splitting multi-byte characters.

    Byte-level tokenizers: a ByteStream. Others: decodes a small window (prefix_offset..end) each step;
    a delta is released only when it does not end in U+FFFD (a partial UTF-8 sequence)."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        vocab = ByteVocab.for_tokenizer(tokenizer, skip_special_tokens)
        self.stream = ByteStream(vocab) if vocab is not None else None

    def _decode(self, ids: list[int]) -> str:
        if len(ids) == 1:
            return decode_piece(self.tokenizer, ids[0], self.skip)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def add(self, token: int) -> str:
        if self.stream is not None:
            return self.stream.add(token)
        self.ids.append(token)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix) :]
        return ""

    def flush(self) -> str:
        """Whatever is held back at the end of generation (e.g. a dangling byte)."""
        if self.stream is not None:
            return self.stream.flush()
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix) :]


class StopStringMatcher:
    """Holds back text that could be the start of a stop string; cuts at a full match."""

    def __init__(self, stops: list[str], include: bool = False):
        """include: the text keeps the stop string that matched (vLLM's include_stop_str_in_output)."""
        self.stops = [s for s in stops if s]
        self.include = include
        self.matched: str | None = None  # the stop string that ended the text
        self.text = ""  # everything generated so far (visible text)
        self.emitted = 0
        self.stopped = False

    def feed(self, delta: str, armed: bool = True) -> str:
        """Add text; return what is now safe to show. Sets .stopped on a match that ends in the new text.
        Unarmed (before min_tokens), nothing matches, but possible starts of a stop string are still held back."""
        if self.stopped:
            return ""
        if not self.stops:  # nothing to hold back or match: the text passes straight through
            return delta
        old = len(self.text)
        self.text += delta
        hits = [(i, s) for s in self.stops if armed and (i := self.text.find(s, max(0, old - len(s) + 1))) >= 0]
        if hits:
            at, self.matched = min(hits)
            self.text = self.text[: at + (len(self.matched) if self.include else 0)]
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
