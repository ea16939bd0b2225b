"""Prompt ids as the model's tokenizer gives them, on every real model (SmolLM2, Qwen2.5, Gemma 3): a raw prompt
with the special tokens its tokenizer adds (Gemma 3's <bos>), a chat prompt as its template writes it (one <bos>),
the same in Python and through the server, each compared with transformers' tokenizer on the converted folder;
and Gemma 3's greedy continuation of a raw prompt through the Python API, `kvtool generate` and /v1/completions,
equal to transformers' greedy continuation."""

from __future__ import annotations

import warnings

import httpx
import pytest
import torch

from kvtool import SamplingParams
from kvtool.engine import Engine
from kvtool.errors import DoubleBosWarning

pytestmark = pytest.mark.real_model

MODELS = {"smollm2": "smol_server", "qwen25": "qwen_server", "gemma3": "gemma_server"}
RAW = ["The capital of France is", " two  spaces, then\n\na blank line", "naïve café 日本", ""]
CHATS = [[{"role": "user", "content": "Name three colours."}],
         [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Sky colour?"}],
         [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
          {"role": "user", "content": "What is 2+2?"}]]
FRANCE = "The capital of France is"
CONTINUE = 8  # greedy tokens compared with transformers


@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import AutoTokenizer

    made = {}

    def get(model):
        if model.name not in made:
            made[model.name] = AutoTokenizer.from_pretrained(str(model.folder))
        return made[model.name]

    return get


def hf_chat(tok, messages, add_generation_prompt: bool = True) -> list[int]:
    return list(tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt,
                                        return_dict=False))


@pytest.mark.parametrize("name", list(MODELS))
def test_prompt_ids_are_the_tokenizers(request, hf_tokenizer, name):
    model = request.getfixturevalue(name)
    tok = hf_tokenizer(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DoubleBosWarning)  # no raw prompt here is rendered text
        for text in RAW:
            assert model.encode(text) == tok.encode(text), text
            assert model.encode(text, add_special_tokens=False) == tok.encode(text, add_special_tokens=False), text
    for messages in CHATS:
        for gen_prompt in (True, False):
            ids = model.encode_chat(messages, add_generation_prompt=gen_prompt)
            assert ids == hf_chat(tok, messages, gen_prompt), messages
            assert ids == model.encode_rendered(model.render(messages, add_generation_prompt=gen_prompt))
            if tok.bos_token_id is not None and name == "gemma3":
                assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1


def test_gemma3_raw_prompts_start_with_bos_and_rendered_text_gets_no_second(gemma3):
    bos = gemma3.tokenizer.bos_token_id
    assert bos == 2
    assert gemma3.encode(FRANCE)[0] == bos and gemma3.encode(FRANCE)[1:] == gemma3.encode(FRANCE, False)
    rendered = gemma3.render(CHATS[0])
    assert rendered.startswith("<bos>")
    with pytest.warns(DoubleBosWarning, match="encode_rendered"):
        doubled = gemma3.encode(rendered)
    assert doubled[:2] == [bos, bos] and doubled[1:] == gemma3.encode_rendered(rendered) == gemma3.encode_chat(CHATS[0])


@pytest.mark.parametrize("name", list(MODELS))
def test_served_prompt_ids_are_the_tokenizers(request, hf_tokenizer, name):
    model, server = request.getfixturevalue(name), request.getfixturevalue(MODELS[name])
    tok = hf_tokenizer(model)
    messages = CHATS[1]
    chat, raw, bare = hf_chat(tok, messages), tok.encode(FRANCE), tok.encode(FRANCE, add_special_tokens=False)
    with httpx.Client(base_url=server.base_url, timeout=300) as http:
        def tokens(**body):
            return http.post("/tokenize", json=body).json()["tokens"]

        def prompt_tokens(route, **body):
            out = http.post(route, json={"max_tokens": 1, "temperature": 0, **body}).json()
            return out["usage"]["prompt_tokens"]

        assert tokens(prompt=FRANCE) == raw and tokens(prompt=FRANCE, add_special_tokens=False) == bare
        assert tokens(messages=messages) == chat
        # vLLM's chat field: the tokenizer's special tokens before the rendered text (Gemma: a second <bos>)
        assert tokens(messages=messages, add_special_tokens=True) == tok.encode(model.render(messages))
        assert http.post("/v1/chat/template", json={"messages": messages}).json()["token_ids"] == chat
        assert prompt_tokens("/v1/completions", prompt=FRANCE) == len(raw)
        assert prompt_tokens("/v1/completions", prompt=FRANCE, add_special_tokens=False) == len(bare)
        assert prompt_tokens("/v1/completions", prompt=raw) == len(raw)  # ids are taken as they are
        assert prompt_tokens("/v1/chat/completions", messages=messages) == len(chat)
        assert prompt_tokens("/v1/chat/completions", messages=messages, add_special_tokens=True) == len(
            tok.encode(model.render(messages)))


def test_gemma3_raw_continuation_is_transformers_greedy(gemma3, gemma3_hf, gemma_server, hf_tokenizer, capsys):
    from kvtool.cli import main
    from kvtool.testing.models import gemma3_gguf

    tok = hf_tokenizer(gemma3)
    ids = tok.encode(FRANCE)
    with torch.no_grad():
        want = gemma3_hf.generate(torch.tensor([ids]), max_new_tokens=CONTINUE, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)[0, len(ids):].tolist()
    text = tok.decode(want, skip_special_tokens=True)
    params = SamplingParams(temperature=0, max_tokens=CONTINUE, ignore_eos=True)
    assert Engine(gemma3).generate(gemma3.encode(FRANCE), params).run().token_ids == want
    # without <bos> Gemma 3 continues otherwise: this is the continuation a prompt missing it gets
    bare = Engine(gemma3).generate(gemma3.encode(FRANCE, add_special_tokens=False), params).run()
    assert bare.token_ids != want

    argv = ["generate", FRANCE, "--model", str(gemma3_gguf()), "--temperature", "0", "--max-tokens", str(CONTINUE)]
    assert main(argv) == 0
    assert capsys.readouterr().out.rstrip("\n") == text
    assert main(argv + ["--no-special-tokens"]) == 0
    assert capsys.readouterr().out.rstrip("\n") == bare.text

    body = {"prompt": FRANCE, "temperature": 0, "max_tokens": CONTINUE, "ignore_eos": True}
    with httpx.Client(base_url=gemma_server.base_url, timeout=300) as http:
        served = http.post("/v1/completions", json=body).json()
        assert served["choices"][0]["text"] == text and served["usage"]["prompt_tokens"] == len(ids)
        served_bare = http.post("/v1/completions", json={**body, "add_special_tokens": False}).json()
        assert served_bare["choices"][0]["text"] == bare.text


def test_no_special_tokens_is_refused_where_the_prompt_is_not_raw(capsys):
    from kvtool.cli import main

    for extra in (["--chat"], ["--suffix", "b"]):
        assert main(["generate", "a", "--model", "unused", "--no-special-tokens", *extra]) == 2
        assert "--no-special-tokens applies to a raw prompt" in capsys.readouterr().err
