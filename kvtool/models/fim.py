"""Fill-in-the-middle: the text between a prefix and a suffix, for code models trained to write it.

A model's FIM tokens are found in its vocabulary (STYLES: Qwen2.5-Coder and CodeGemma-style
`<|fim_prefix|>`, StarCoder/SmolLM-style `<fim_prefix>`, CodeLlama's `▁<PRE>`, DeepSeek-Coder's
`<｜fim▁begin｜>`). The prompt is prefix-suffix-middle order, [PRE] prefix [SUF] suffix [MID], built from
token ids, the prefix and suffix text encoded with special tokens spelled out (plain_ids), so text in
them can never be read as a FIM token. The model writes the
middle and ends it with an end-of-text or FIM token (STOPS found in the vocabulary), the extra stop
tokens of a FIM request.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvtool.errors import InvalidParameterError

STYLES = (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"), ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
          ("▁<PRE>", "▁<SUF>", "▁<MID>"), ("<PRE>", "<SUF>", "<MID>"),
          ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"))
STOPS = ("<|endoftext|>", "<|fim_pad|>", "<|file_sep|>", "<|repo_name|>", "<|fim_prefix|>", "<fim_pad>", "<file_sep>",
         "<|file_separator|>", "<EOT>", "▁<EOT>", "<｜end▁of▁sentence｜>", "<|end_of_text|>", "</s>")


@dataclass(frozen=True)
class FimFormat:
    prefix: int  # token ids
    suffix: int
    middle: int
    stops: tuple[int, ...]  # tokens that end the middle

    def prompt(self, prefix_ids: list[int], suffix_ids: list[int]) -> list[int]:
        return [self.prefix, *prefix_ids, self.suffix, *suffix_ids, self.middle]

    def sampling(self, params):
        """params (a SamplingParams) that also stop at this format's end-of-middle tokens."""
        return dataclasses.replace(params, stop_token_ids=[*params.stop_token_ids, *self.stops]).validate()


def plain_ids(tokenizer, text: str) -> list[int]:
    """text as ordinary tokens: "<|fim_suffix|>" written in it is spelled out, not read as the special token."""
    return tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)


def fim_format(tokenizer, name: str = "this model") -> FimFormat:
    """The FIM tokens of a tokenizer; InvalidParameterError when it has none."""
    vocab = tokenizer.get_vocab()
    for style in STYLES:
        if all(token in vocab for token in style):
            stops = [vocab[t] for t in STOPS if t in vocab]
            if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in stops:
                stops.append(tokenizer.eos_token_id)
            return FimFormat(*(vocab[t] for t in style), tuple(stops))
    raise InvalidParameterError(f"{name} has no fill-in-the-middle tokens ({', '.join(s[0] for s in STYLES[:3])}, "
                                "...), so it cannot take a suffix; serve a code model trained for it, such as "
                                "Qwen2.5-Coder")
