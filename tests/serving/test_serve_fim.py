"""Fill in the middle (`suffix` on /v1/completions, `kvtool generate --suffix`) with Qwen2.5-Coder's FIM tokens;
a model without them, and echo with a suffix, get a 400 naming the problem."""

from __future__ import annotations

import pytest
from openai import OpenAI

from kvtool.models.fim import fim_format, plain_ids

pytestmark = pytest.mark.real_model

ADD = {"prompt": "def add(a, b):\n    ", "suffix": "\n\n\nprint(add(2, 3))\n"}


def test_the_fim_prompt_is_prefix_suffix_middle_and_spells_out_fim_text(qwen25):
    tok = qwen25.tokenizer
    fim = fim_format(tok)
    vocab = tok.get_vocab()
    assert (fim.prefix, fim.suffix, fim.middle) == (vocab["<|fim_prefix|>"], vocab["<|fim_suffix|>"],
                                                    vocab["<|fim_middle|>"])
    assert {vocab["<|endoftext|>"], vocab["<|fim_pad|>"], vocab["<|file_sep|>"]} <= set(fim.stops)
    sneaky = plain_ids(tok, "x = '<|fim_suffix|>'")
    assert fim.suffix not in sneaky and tok.decode(sneaky) == "x = '<|fim_suffix|>'"
    prompt = fim.prompt(plain_ids(tok, "a"), plain_ids(tok, "b"))
    assert prompt == [fim.prefix, *plain_ids(tok, "a"), fim.suffix, *plain_ids(tok, "b"), fim.middle]


def test_completion_fills_in_the_middle(qwen):
    body = {**ADD, "temperature": 0, "max_tokens": 24, "stop": ["\n\n"]}
    out = qwen.post("/v1/completions", json=body).json()
    choice = out["choices"][0]
    assert choice["text"] == "return a + b" and choice["finish_reason"] == "stop" and choice["stop_reason"] == "\n\n"
    plain = qwen.post("/v1/completions", json={**body, "suffix": None}).json()["choices"][0]["text"]
    assert plain != choice["text"]  # without the suffix the same prompt is continued, not filled
    client = OpenAI(base_url=str(qwen.base_url) + "/v1", api_key="unused", max_retries=0)
    streamed = client.completions.create(model="default", stream=True, **body)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == "return a + b"


def test_fim_ends_at_the_models_stop_tokens_when_they_come(qwen, qwen25):
    out = qwen.post("/v1/completions", json={"prompt": "names = ['bo', 'al']\nfor name in names:\n",
                                             "suffix": "\nprint('done')\n", "temperature": 0, "max_tokens": 48}).json()
    choice = out["choices"][0]
    assert choice["text"].startswith("print(name)")
    assert choice["finish_reason"] == "length" or choice["stop_reason"] in (None, *fim_format(qwen25.tokenizer).stops)


def test_a_model_without_fim_tokens_and_echo_with_a_suffix_are_refused(smol, qwen):
    r = smol.post("/v1/completions", json={**ADD, "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"
    message = r.json()["error"]["message"]
    assert "no fill-in-the-middle tokens" in message and "Qwen2.5-Coder" in message
    r = qwen.post("/v1/completions", json={**ADD, "max_tokens": 4, "echo": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"


def test_cli_generate_with_a_suffix(capsys):
    from kvtool.cli import main
    from kvtool.testing.models import qwen25_gguf, smollm2_gguf

    assert main(["generate", ADD["prompt"], "--suffix", ADD["suffix"], "--temperature", "0", "--stop", "\n\n",
                 "--max-tokens", "24", "--model", str(qwen25_gguf())]) == 0
    out = capsys.readouterr()
    assert out.out == "return a + b" and "[stop '\\n\\n']" in out.err

    assert main(["generate", "def f():", "--suffix", "x", "--chat", "--model", "/unused"]) != 0
    assert "drop --chat" in capsys.readouterr().err
    assert main(["generate", "def f():", "--suffix", "x", "--max-tokens", "2", "--model", str(smollm2_gguf())]) != 0
    assert "no fill-in-the-middle tokens" in capsys.readouterr().err
