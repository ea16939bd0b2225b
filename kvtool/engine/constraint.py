"""Constrained decoding: one llguidance matcher per request, its token mask applied to the logits.

A Grammars object per engine holds the llguidance tokenizer (built once from the model's Hugging Face
tokenizer, over the model's whole vocabulary: ids past the tokenizer's are never allowed) and makes a
Constraint per request from a grammar of kvtool.structured.grammar. Each step the Sampler asks the
Constraint to mask its logits (-inf where the grammar refuses the token) before temperature and truncation,
on the single and the batched path alike, and tells it the token drawn. When the grammar allows exactly one
token (a fixed key, a closing brace) the matcher names it, and the mask is that one token without a full
mask computation. The matcher fills a bitmask on the host, numpy unpacks it there, and the row of allowed
tokens goes to the logits' device: the same code serves CPU and CUDA tensors. Many requests at once
(allowed_rows, for the batched sampler) get their masks filled by llguidance's thread pool in one call, unpacked
together, and sent to the device as one [rows, V] tensor.

The grammar ends with the end of the turn: where it may end, the request's stop tokens are allowed (the
model's end-of-turn tokens, or stop_token_ids); where it must end, they are all that is allowed.
"""

from __future__ import annotations

import numpy as np
import torch
from llguidance import LLExecutor, LLMatcher

from kvtool.errors import InvalidParameterError
from kvtool.structured.grammar import unwritable_chars

NEG = float("-inf")
_EXECUTOR: LLExecutor | None = None  # llguidance's thread pool for the masks of many requests, made on first use


def executor() -> LLExecutor:
    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = LLExecutor()
    return _EXECUTOR


class Grammars:
    """The llguidance tokenizer of one model, and the Constraints built on it."""

    def __init__(self, tokenizer, vocab_size: int, end_of_turn):
        import llguidance.hf

        self.vocab_size = vocab_size
        self.eos = sorted(end_of_turn)
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, vocab_size, eos_token=self.eos[0] if self.eos
                                                      else None)
        # text -> id of the tokens llguidance keeps apart from text: the added tokens, such as Qwen2.5's
        # <tool_call>; a grammar names them as tokens (`<tool_call>`, `<[151657]>`), never as text
        self.specials = {a.content: i for i, a in tokenizer.added_tokens_decoder.items()
                         if i < vocab_size and self.tokenizer.is_special_token(i)}
        self.names = {i: name for name, i in self.specials.items()}
        self.special_ids = np.array(sorted(set(self.names) - set(self.eos)), dtype=np.int64)
        plain = [t for t in range(min(vocab_size, len(tokenizer))) if not self.tokenizer.is_special_token(t)]
        self.unwritable = unwritable_chars(set(self.tokenizer.decode_bytes(plain)))

    def constraint(self, grammar: str, stop_ids) -> "Constraint":
        return Constraint(self, grammar, stop_ids)


class Constraint:
    """One request's matcher: mask(logits) before each draw, accept(token) after it."""

    def __init__(self, grammars: Grammars, grammar: str, stop_ids):
        self.vocab_size = grammars.vocab_size
        self.stops = sorted(t for t in stop_ids if t < self.vocab_size)
        if not self.stops:
            raise InvalidParameterError("structured output ends with the end of the turn; this request has no token "
                                        "that ends it (ignore_eos without stop_token_ids)")
        self.matcher = LLMatcher(grammars.tokenizer, grammar, log_level=0)
        self._raise_on_error()
        self.bits = np.empty((self.vocab_size + 31) // 32, dtype=np.uint32)  # the matcher writes its mask here
        self.eos = [t for t in grammars.eos if t < self.vocab_size]
        self.special_ids, self.names, self.tokenizer = grammars.special_ids, grammars.names, grammars.tokenizer
        self._next: np.ndarray | None = None
        self._next = self._allowed()  # the first step's row, now: a request it leaves nothing to is refused at once
        if not self._next.any():
            raise InvalidParameterError("structured output: no text this model can write satisfies the grammar")

    def _raise_on_error(self) -> None:
        if self.matcher.is_error():
            reason = (self.matcher.get_error().strip().splitlines() or ["the matcher failed"])[0]
            if reason == "NoExtensionBias":  # llguidance: the mask came out empty
                reason = "no text this model can write satisfies the grammar from here"
            raise InvalidParameterError(f"structured output: {reason}")

    def forced(self) -> int | None:
        """The one token the grammar allows next (before its end), or None when it allows more."""
        ff = self.matcher.compute_ff_tokens()
        # the forced text is tokenized as plain text would be, so text spelling a special token (`</tool_call>`
        # inside a JSON string) comes back as that token, which the grammar refuses: then the full mask decides
        return ff[0] if ff and self.matcher.validate_tokens(ff[:1]) == 1 else None

    def allowed(self, device: torch.device) -> torch.Tensor:
        """bool [vocab_size] on device: the tokens that may come next."""
        return torch.from_numpy(self._allowed()).to(device, non_blocking=True)

    def _allowed(self) -> np.ndarray:
        # numpy on the host: one pass, no thread-pool ops per step; the device gets the finished row
        ok = self._settled()
        if ok is not None:
            return ok
        self.matcher.unsafe_compute_mask_ptr(self.bits.ctypes.data, self.bits.nbytes)
        return self._finish(np.unpackbits(self.bits.view(np.uint8), bitorder="little")[: self.vocab_size].astype(bool))

    def _settled(self) -> np.ndarray | None:
        """The allowed row when no mask is needed: the first step's (computed with the request), after the
        grammar's end (its stop tokens), or the one token it forces; None when the matcher has to compute the mask."""
        if self._next is not None:
            return self._next
        allowed = self.stops if self.matcher.is_stopped() else self.forced()
        if allowed is None:
            return None
        ok = np.zeros(self.vocab_size, dtype=bool)
        ok[allowed] = True
        return ok

    def _finish(self, ok: np.ndarray) -> np.ndarray:
        """The matcher's unpacked mask -> the allowed row: end of turn only where the grammar may end."""
        self._raise_on_error()
        ok[self.eos] = False
        self._drop_spelled_specials(ok)
        ok[self.stops] = self.matcher.is_accepting()
        return ok

    def _drop_spelled_specials(self, ok: np.ndarray) -> None:
        """Where the grammar spells a special token's text (a regex or a JSON string with `<tool_call>` on Qwen2.5),
        llguidance's mask offers that token, which the matcher then refuses: the text is written in plain tokens
        instead, the first of them allowed alone. InvalidParameterError when no plain token can start it."""
        specials = self.special_ids[ok[self.special_ids]]
        refused = [t for t in specials.tolist() if self.matcher.validate_tokens([t]) != 1]
        if not refused:
            return
        ok[refused] = False
        if ok.any():
            return
        text = self.matcher.compute_ff_bytes().decode("utf-8", errors="ignore")
        plain = self.tokenizer.greedy_tokenize(text)[:1] if text else []
        if plain and plain[0] < self.vocab_size and self.matcher.validate_tokens(plain) == 1:
            ok[plain[0]] = True
            return
        raise InvalidParameterError(f"structured output: the grammar spells {self.names[refused[0]]} as text, which "
                                    "this model writes only as a special token; write it as a token in a Lark "
                                    f"grammar (`{self.names[refused[0]]}` or `<[{refused[0]}]>`)")

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V]: -inf where the grammar refuses the token."""
        return logits.masked_fill(~self.allowed(logits.device), NEG)

    def accept(self, token: int) -> None:
        self._next = None
        if token in self.stops:  # the turn ends here: the matcher has nothing more to follow
            if not (self.matcher.is_stopped() or self.matcher.is_accepting()):
                raise InvalidParameterError(f"structured output: the turn ended (token {token}) before the output "
                                            "was complete")
            return
        if self.matcher.is_stopped():
            raise InvalidParameterError(f"structured output: token {token} follows the end of the grammar")
        if not self.matcher.consume_token(token):
            self._raise_on_error()
            raise InvalidParameterError(f"structured output: token {token} does not continue the output")


def allowed_rows(constraints: list[Constraint], device: torch.device) -> torch.Tensor:
    """bool [len(constraints), V] on device: each request's allowed tokens. The masks the matchers must compute
    are filled by llguidance's thread pool in one call and unpacked together; one transfer to the device."""
    vocab = constraints[0].vocab_size
    rows = [c._settled() for c in constraints]
    todo = [i for i, row in enumerate(rows) if row is None]
    ok = np.stack([np.zeros(vocab, dtype=bool) if row is None else row for row in rows])
    if todo:
        bits = np.empty((len(todo), (vocab + 31) // 32), dtype=np.int32)
        executor().unsafe_compute_mask_ptr([(constraints[i].matcher, j) for j, i in enumerate(todo)],
                                           bits.ctypes.data, bits.shape[1] * 4, len(todo))
        unpacked = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, :vocab].astype(bool)
        for j, i in enumerate(todo):
            ok[i] = constraints[i]._finish(unpacked[j])
    return torch.from_numpy(ok).to(device, non_blocking=True)
