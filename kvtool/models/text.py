"""The text side of a model: tokenizer, chat template and end-of-turn tokens, without weights.

ModelText is what every loaded model shares (kvtool.load's LoadedModel); TextModel is that alone, for an
engine that holds the weights itself (kvtool serve --engine vllm).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtool.config import SamplingDefaults
from kvtool.errors import DoubleBosWarning, InvalidParameterError, ModelLoadError
from kvtool.ids import as_token_ids
from kvtool.models.spec import ModelSpec

# Tokens that end a turn in the chat formats kvtool serves.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>")


class ModelText:
    """Text <-> ids, the chat template, end of turn; needs `name`, `tokenizer` and `hf_config`."""

    @property
    def chat_template(self) -> str | None:
        return getattr(self.tokenizer, "chat_template", None)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A raw prompt's ids as its tokenizer encodes it: with the special tokens it adds (Gemma's and Llama's
        `<bos>` first; none for Qwen or SmolLM2), as `/v1/completions` and transformers' `encode` do.
        add_special_tokens=False: none added. Chat text goes through encode_chat or encode_rendered."""
        if not isinstance(text, str):
            raise InvalidParameterError(f"encode() takes text (a str); got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:  # a lone surrogate, or bytes the command line could not decode
            raise InvalidParameterError(f"the text is not valid UTF-8 / Unicode (an unpaired surrogate or an "
                                        f"undecodable byte at character {exc.start}); send valid UTF-8 text") from None
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        bos = self.tokenizer.bos_token_id
        if add_special_tokens and bos is not None and ids[:2] == [bos, bos]:
            warnings.warn(f"the prompt starts with {self.tokenizer.bos_token} and {self.name}'s tokenizer adds "
                          "another: it is rendered chat text, so encode it with encode_rendered (or encode_chat "
                          "the messages)", DoubleBosWarning, stacklevel=2)
        return ids

    def encode_rendered(self, text: str) -> list[int]:
        """Text that holds the special tokens it needs (a rendered chat template, a piece of one, or text that
        continues other tokens), tokenized as written: no special token added."""
        return self.encode(text, add_special_tokens=False)

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True,
                    **template_kwargs) -> list[int]:
        """The rendered conversation's ids, as `apply_chat_template(..., tokenize=True)` gives them."""
        return self.encode_rendered(self.render(messages, tools, add_generation_prompt, **template_kwargs))

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        ids = as_token_ids(ids, "decode() ids")
        size = len(self.tokenizer)
        bad = [t for t in ids if not 0 <= t < size]
        if bad:
            raise InvalidParameterError(f"decode() ids must be in [0, {size}) (the tokenizer's vocabulary); "
                                        f"got {bad[:5]}")
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def render(self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True,
               **template_kwargs) -> str:
        if not self.chat_template:
            raise ModelLoadError(f"model {self.name} has no chat template; use a raw prompt")
        if isinstance(messages, (str, bytes)) or not isinstance(messages, (list, tuple)) or any(
                not isinstance(m, Mapping) or not isinstance(m.get("role"), str) for m in messages):
            raise InvalidParameterError("messages must be a list of dicts, each with a 'role' string "
                                        "({'role': 'user', 'content': '...'})")
        if tools is not None and (not isinstance(tools, (list, tuple)) or any(not isinstance(t, Mapping)
                                                                              for t in tools)):
            raise InvalidParameterError("tools must be a list of tool dicts ({'type': 'function', 'function': ...})")
        try:
            return self.tokenizer.apply_chat_template(list(messages), tools=tools, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt, **template_kwargs)
        except Exception as exc:  # the template sees only the caller's messages: its complaints are about them
            raise InvalidParameterError(f"the chat template could not render these messages: "
                                        f"{type(exc).__name__}: {exc}") from None

    def end_of_turn_ids(self) -> list[int]:
        ids = set()
        eos = self.hf_config.eos_token_id if hasattr(self.hf_config, "eos_token_id") else None
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        vocab = self.tokenizer.get_vocab()
        ids.update(vocab[t] for t in END_OF_TURN_TOKENS if t in vocab)
        return sorted(ids)


@dataclass
class TextModel(ModelText):
    name: str
    folder: Path  # the HF folder (the converted one for GGUF) the engine loads the weights from
    tokenizer: Any
    hf_config: Any
    spec: ModelSpec
    source: str = ""
    precision: str = "auto"  # what the engine runs in; set once the engine has resolved it
    context_window: int = 0  # the engine's max model length; 0: the config's max_position_embeddings
    sampling_defaults: SamplingDefaults = SamplingDefaults()  # what requests that name none sample with

    def __post_init__(self):
        self.context_window = self.context_window or self.spec.max_position
        self.info = {"device": "engine", "dtype": self.precision, "weights": "dense"}
