"""Token labels, role and channel of every token, and named spans.

Pieces are single tokens decoded verbatim (special tokens included). Roles and channels come
from the ChatML structure of the joined text: `<|im_start|>ROLE\\n … <|im_end|>`, and inside a
turn `<think>…</think>` (reasoning), `<tool_call>…</tool_call>`, `<tool_response>…</tool_response>`.
Tags match as text, so they work whether a tag is one added token (Qwen) or several (SmolLM2).
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass, field

from kvtool.errors import InvalidParameterError

CHANNELS = ("special", "reasoning", "content", "tool_call", "tool_response")
# tag -> (channel, roles whose turns it can mark); the system turn quotes tags in its tool instructions.
REGION_TAGS = {"think": ("reasoning", ("assistant",)), "tool_call": ("tool_call", ("assistant",)),
               "tool_response": ("tool_response", ("user", "tool"))}
_TURN = re.compile(r"<\|im_start\|>([^\n<]*)\n?")
_END = "<|im_end|>"


@dataclass
class Tokens:
    ids: list[int]
    pieces: list[str]
    n_prompt: int  # tokens before generated ones
    roles: list[str] = field(default_factory=list)
    channels: list[str] = field(default_factory=list)

    def __post_init__(self):
        self.text = "".join(self.pieces)
        self.offsets = [0]
        for p in self.pieces:
            self.offsets.append(self.offsets[-1] + len(p))
        if not self.roles:
            self.roles, self.channels = classify(self.text, self.offsets, self.pieces)

    def __len__(self) -> int:
        return len(self.ids)

    def token_at(self, char: int) -> int:
        """Index of the token whose text covers character `char`."""
        return max(0, bisect.bisect_right(self.offsets, char) - 1)

    def char_span(self, a: int, b: int) -> tuple[int, int]:
        """Token range [i, j) covering characters [a, b)."""
        return self.token_at(a), self.token_at(max(a, b - 1)) + 1

    def records(self) -> list[dict]:
        return [{"i": i, "id": t, "piece": p, "role": r, "channel": c, "generated": i >= self.n_prompt}
                for i, (t, p, r, c) in enumerate(zip(self.ids, self.pieces, self.roles, self.channels))]


def make_tokens(model, ids: list[int], n_prompt: int | None = None) -> Tokens:
    pieces = model.tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False,
                                          clean_up_tokenization_spaces=False)
    tokens = Tokens(list(ids), pieces, len(ids) if n_prompt is None else n_prompt)
    special = set(model.tokenizer.all_special_ids)
    for i, t in enumerate(tokens.ids):
        if t in special and tokens.channels[i] == "content":
            tokens.channels[i] = "special"
    return tokens


def classify(text: str, offsets: list[int], pieces: list[str]) -> tuple[list[str], list[str]]:
    """Per token (role, channel) from the ChatML structure of `text`."""
    n = len(pieces)
    char_role = [""] * len(text)
    char_chan = ["content"] * len(text)
    for m in _TURN.finditer(text):
        role = m.group(1).strip()
        end = text.find(_END, m.end())
        stop = len(text) if end < 0 else end
        close = stop + len(_END) if end >= 0 else stop
        close += text.startswith("\n", close)  # the newline between turns belongs to the template
        char_role[m.start() : close] = [role] * (close - m.start())
        char_chan[m.start() : m.end()] = ["special"] * (m.end() - m.start())
        if role == "tool":
            char_chan[m.end() : stop] = ["tool_response"] * (stop - m.end())
        for tag, (chan, roles) in REGION_TAGS.items():
            if role in roles:
                for a, b in tag_blocks(text, tag, m.end(), stop):
                    char_chan[a:b] = [chan] * (b - a)
        char_chan[stop:close] = ["special"] * (close - stop)
    roles, chans = [], []
    for i in range(n):
        a, b = offsets[i], offsets[i + 1]
        if a == b:
            roles.append(char_role[a - 1] if a else "")
            chans.append("special")
            continue
        stripped = len(pieces[i]) - len(pieces[i].lstrip())
        c = a + stripped if stripped < b - a else a  # a token is where its first visible char is
        roles.append(char_role[c])
        chans.append(char_chan[c])
    return roles, chans


def tag_blocks(text: str, tag: str, lo: int = 0, hi: int | None = None) -> list[tuple[int, int]]:
    """Character ranges of `<tag>…</tag>` blocks (tags included) in text[lo:hi]; an unclosed one runs to hi."""
    hi = len(text) if hi is None else hi
    open_, close = f"<{tag}>", f"</{tag}>"
    out, i = [], text.find(open_, lo, hi)
    while i >= 0:
        j = text.find(close, i + len(open_), hi)
        end = hi if j < 0 else j + len(close)
        out.append((i, end))
        i = text.find(open_, end, hi)
    return out


def find_spans(tokens: Tokens, spec: str) -> list[tuple[int, int]]:
    """Token ranges [i, j) named by `spec`:
    A:B (token range) | tag:NAME or <NAME> (every <NAME>…</NAME> block) | text:LITERAL |
    channel:NAME (runs of a channel) | role:NAME (runs of a role)."""
    spec = spec.strip()
    kind, _, arg = spec.partition(":")
    if re.fullmatch(r"<\w+>", spec):
        kind, arg = "tag", spec[1:-1]
    spans: list[tuple[int, int]]
    if re.fullmatch(r"-?\d*:-?\d*", spec):
        from kvtool.viz.select import parse_indices

        idx = parse_indices(spec, len(tokens), "token")
        spans = [(idx[0], idx[-1] + 1)]
    elif kind == "tag" and arg:
        spans = [tokens.char_span(a, b) for a, b in tag_blocks(tokens.text, arg)]
    elif kind == "text" and arg:
        spans = [tokens.char_span(m.start(), m.end()) for m in re.finditer(re.escape(arg), tokens.text)]
    elif kind in ("channel", "role") and arg:
        if kind == "channel" and arg not in CHANNELS:
            raise InvalidParameterError(f"unknown channel {arg!r}; use one of {', '.join(CHANNELS)}")
        values = tokens.channels if kind == "channel" else tokens.roles
        spans = runs([v == arg for v in values])
    else:
        raise InvalidParameterError(f"bad span {spec!r}: use A:B, tag:NAME (or <NAME>), text:LITERAL, "
                                    "channel:NAME or role:NAME")
    if not spans:
        raise InvalidParameterError(f"span {spec!r} matches no tokens in this input")
    return spans


def runs(flags: list[bool]) -> list[tuple[int, int]]:
    out, start = [], None
    for i, f in enumerate(flags + [False]):
        if f and start is None:
            start = i
        elif not f and start is not None:
            out.append((start, i))
            start = None
    return out


def span_mask(n: int, spans: list[tuple[int, int]]) -> list[bool]:
    mask = [False] * n
    for a, b in spans:
        mask[a:b] = [True] * (b - a)
    return mask


def label(piece: str, width: int = 14) -> str:
    """A plot label: whitespace made visible, long pieces cut."""
    out = piece.replace("\n", "\\n").replace("\t", "\\t")
    out = out if out.strip() else out.replace(" ", "␣")
    return out if len(out) <= width else out[: width - 1] + "…"


class ChannelTracker:
    """Channel of each streamed token, classified in the context of the turn the prompt opened."""

    def __init__(self, prompt_text: str):
        start = prompt_text.rfind("<|im_start|>")
        self.head = prompt_text[start:] if start >= 0 else ""
        self.pieces: list[str] = []

    def feed(self, piece: str) -> str:
        self.pieces.append(piece)
        pieces = [self.head, *self.pieces]
        offsets = [0]
        for p in pieces:
            offsets.append(offsets[-1] + len(p))
        return classify("".join(pieces), offsets, pieces)[1][-1]
