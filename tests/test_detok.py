"""Streaming detokenization of the real byte-level tokenizers: the byte stream equals the tokenizer's decode()."""

import random

import pytest

from kvtool.engine.detok import ByteVocab, IncrementalDetokenizer

TEXT = ("Größe: 10 µm — naïve café 日本語のテキスト 🚀🎉 ok\n\tdef f(x):\n"
        "        return x ** 2  # ✓\n<tool_call>\n{\"name\": \"f\"}\n</tool_call>")


def streamed(tok, ids, skip):
    d = IncrementalDetokenizer(tok, skip)
    deltas = [d.add(t) for t in ids]
    return deltas, "".join(deltas) + d.flush(), d


@pytest.mark.real_model
@pytest.mark.parametrize("name", ["smollm2", "qwen25"])
@pytest.mark.parametrize("skip", [True, False])
def test_byte_stream_equals_decode(name, skip, request):
    tok = request.getfixturevalue(name).tokenizer
    assert ByteVocab.for_tokenizer(tok, skip) is not None  # these tokenizers take the byte path
    ids = tok.encode(TEXT, add_special_tokens=False)
    deltas, text, d = streamed(tok, ids, skip)
    assert d.stream is not None and text == tok.decode(ids, skip_special_tokens=skip)
    # a character split over several tokens shows once it is whole, never as U+FFFD
    assert "\ufffd" not in "".join(deltas) and "🚀" in text
    rng = random.Random(0)
    added = list(tok.added_tokens_decoder)
    for _ in range(30):  # random ids, specials among them: partial bytes become U+FFFD exactly as in decode()
        ids = [rng.choice(added) if rng.random() < 0.1 else rng.randrange(len(tok)) for _ in range(rng.randint(1, 40))]
        assert streamed(tok, ids, skip)[1] == tok.decode(ids, skip_special_tokens=skip), ids


@pytest.mark.real_model
def test_held_back_bytes_come_out_with_the_character_they_complete(qwen25):
    tok = qwen25.tokenizer
    # 日 spelt as its three bytes, one token each
    ids = [tok.convert_tokens_to_ids(c) for c in ("æ", "Ĺ", "¥")]
    assert streamed(tok, ids, True)[0] == ["", "", "日"]
    deltas, text, _ = streamed(tok, ids[:2], True)  # cut short: what is left shows as U+FFFD at the end
    assert deltas == ["", ""] and text == tok.decode(ids[:2]) == "\ufffd"


def test_tokenizers_that_are_not_byte_level_keep_the_window_decoder():
    class Plain:
        clean_up_tokenization_spaces = False

        def decode(self, ids, skip_special_tokens=False):
            return "".join(chr(96 + i) for i in ids)

    assert ByteVocab.for_tokenizer(Plain(), True) is None
    d = IncrementalDetokenizer(Plain())
    assert d.stream is None and "".join(d.add(t) for t in (1, 2, 3)) + d.flush() == "abc"
