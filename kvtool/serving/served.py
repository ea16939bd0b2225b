"""The served model as the HTTP layer sees it: names, special tokens, text <-> ids.

Works on token ids and strings only; the tensors stay behind the worker.
"""

from __future__ import annotations

from functools import cached_property, lru_cache

from kvtool.errors import ContextWindowError, InvalidParameterError
from kvtool.serving.errors import ModelNotFound, ServingError

TOOL_PROBE = [{"type": "function", "function": {"name": "kvtool_probe", "description": "probe",
                                                "parameters": {"type": "object", "properties": {}}}}]


class ServedModel:
    def __init__(self, model, served_name: str | None = None):
        self.model = model
        self.name = served_name or model.name
        # Clients may name the model by its served name, its own name, the path it came from, or "default".
        self.aliases = {self.name, model.name, str(getattr(model, "source", "") or model.name), "default"}
        tok = model.tokenizer
        self.tokenizer = tok
        added = getattr(tok, "added_tokens_decoder", {}) or {}
        self.special_ids = set(tok.all_special_ids) | {i for i, a in added.items() if getattr(a, "special", False)}
        self.vocab_size = model.spec.vocab_size
        self.tokenizer_size = len(tok)
        self.context_window = model.context_window
        self.precision = model.precision  # e.g. "float32", or "float32/int4" with --weights int4
        self.skills = None  # a kvtool.skills SkillCatalog when serving with --skills
        self.engine = "kvtool"  # the backend computing (create_app sets it)

    def check_name(self, requested: str | None) -> None:
        if requested is not None and requested not in self.aliases:
            raise ModelNotFound(f"model {requested!r} is not served here; this server serves {self.name!r} "
                                "(GET /v1/models lists it)", param="model", code="model_not_found")

    @cached_property
    def supports_tools(self) -> bool:
        """Whether the chat template renders tool definitions at all (SmolLM2's does not)."""
        if not self.model.chat_template:
            return False
        msgs = [{"role": "user", "content": "x"}]
        try:
            return self.model.render(msgs, tools=TOOL_PROBE) != self.model.render(msgs)
        except Exception:  # a template that chokes on tools does not support them
            return False

    def check_prompt_text(self, text: str, where: str = "text") -> None:
        check_prompt_text(self, text, where)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A raw prompt gets the special tokens its tokenizer adds; rendered chat text is encoded without them."""
        self.check_prompt_text(text)
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def check_ids(self, ids: list[int], what: str = "tokens") -> None:
        bad = [t for t in ids if not 0 <= t < self.tokenizer_size]
        if bad:
            raise InvalidParameterError(f"{what} must be token ids in [0, {self.tokenizer_size}); got {bad[:5]}")

    def decode(self, ids: list[int]) -> str:
        self.check_ids(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def piece(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def pieces(self, ids: list[int]) -> list[str]:
        return [self.piece(i) for i in ids]


def check_text(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ServingError(f"{where} contains an unpaired UTF-16 surrogate at character {exc.start}; "
                           "send valid Unicode text", param=where) from None


def check_strings(value, where: str) -> None:
    """check_text on every string (keys too) inside a parsed JSON value; the error names the string's path."""
    stack = [(value, where)]
    while stack:  # no recursion: the body may nest as deep as the JSON parser allowed
        item, path = stack.pop()
        if isinstance(item, str):
            check_text(item, path)
        elif isinstance(item, dict):
            for key in item:
                if isinstance(key, str):
                    check_text(key, f"{path} (a key)")
            stack.extend((v, f"{path}.{k}") for k, v in reversed(item.items()))
        elif isinstance(item, list):
            stack.extend((v, f"{path}[{i}]") for i, v in reversed(list(enumerate(item))))


@lru_cache(maxsize=8)
def max_piece_chars(tokenizer) -> int:
    """The longest token in characters (vocab strings: a byte-level BPE string has one character per byte, so
    never fewer than the text it covers), computed once per tokenizer."""
    return max(1, max(map(len, tokenizer.get_vocab()), default=1))


def check_prompt_text(model, text: str, where: str) -> None:
    """400 before tokenizing: a lone surrogate, or more characters than model's context window can hold (model:
    anything with context_window and tokenizer, a ServedModel or a LoadedModel)."""
    check_text(text, where)
    check_fits(text, model.context_window, model.tokenizer)


def check_fits(text: str, window: int, tokenizer) -> None:
    """The context-window 400 without tokenizing: text longer than `window` of the longest token cannot fit
    (so a many-megabyte prompt costs no tokenizer time or memory)."""
    most = window * max_piece_chars(tokenizer)
    if len(text) > most:
        raise ContextWindowError(f"the prompt has {len(text)} characters, more than the model's context window of "
                                 f"{window} tokens can hold (at most {most} characters, "
                                 f"{max_piece_chars(tokenizer)} per token); shorten the prompt")
