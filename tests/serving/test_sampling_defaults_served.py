"""The model's sampling defaults through the real server, the CLI and Python on the embedded SmolLM2: a request
that names no temperature samples as its card recommends (temperature 0.2, top_p 0.9), /v1/models says so."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

import kvtool
from kvtool.config import SamplingDefaults
from kvtool.engine import Engine
from kvtool.models.sampling_defaults import sampling_defaults

pytestmark = pytest.mark.real_model

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
SMOL_CARD = {"temperature": 0.2, "top_p": 0.9, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
             "presence_penalty": 0.0, "frequency_penalty": 0.0, "source": "model card: SmolLM2-135M-Instruct"}
CARD_VALUES = {k: v for k, v in SMOL_CARD.items() if k != "source"}


def readme_request() -> dict:
    """The body of the README's first request (its first curl to /v1/chat/completions)."""
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    found = re.search(r"curl -s localhost:8000/v1/chat/completions .*? -d '(\{.*?\})'", readme, re.S)
    assert found, "the README has no chat completions curl"
    return json.loads(found.group(1))


def ask(client, seed: int, messages=FRANCE, **fields) -> str:
    body = {"messages": messages, "max_tokens": 16, "seed": seed, **fields}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def test_models_shows_the_defaults_and_their_source(smol):
    assert smol.get("/v1/models").json()["data"][0]["sampling_defaults"] == SMOL_CARD


def test_the_readme_request_says_paris(smol):
    """The README's first request, no temperature, 10 seeds: Paris at least 8 times."""
    body = readme_request()
    assert "temperature" not in body
    answers = [ask(smol, seed, **body) for seed in range(10)]
    assert sum("Paris" in a for a in answers) >= 8, answers


def test_the_open_questions_first_token_is_the_models_own(smol, smollm2, smollm2_hf):
    """"What is the capital of France?" opens with 'The' or 'L' about 60:40 at the card's settings, and an 'L'
    opening goes on in French without Paris; that split is the model's own: the served prompt is transformers'
    chat template and the served first-token distribution is transformers' on it."""
    ids = smollm2.encode_chat(FRANCE)
    assert ids == list(smollm2.tokenizer.apply_chat_template(FRANCE, add_generation_prompt=True, tokenize=True,
                                                             return_dict=False))
    body = {"messages": FRANCE, "max_tokens": 1, "logprobs": True, "top_logprobs": 10, "seed": 0}
    served = smol.post("/v1/chat/completions", json=body).json()["choices"][0]["logprobs"]["content"][0]
    with torch.inference_mode():
        logits = smollm2_hf(torch.tensor([ids])).logits[0, -1].float()
    want = torch.log_softmax(logits, -1).topk(10)
    assert [t["token"] for t in served["top_logprobs"]] == [smollm2.decode([i]) for i in want.indices.tolist()]
    assert [t["logprob"] for t in served["top_logprobs"]] == pytest.approx(want.values.tolist(), abs=1e-3)
    probs = torch.softmax(logits / SMOL_CARD["temperature"], -1).sort(descending=True).values
    assert int((probs.cumsum(0) - probs < SMOL_CARD["top_p"]).sum()) == 2  # the tokens top_p keeps
    assert [t["token"] for t in served["top_logprobs"][:2]] == ["The", "L"]


def test_unset_fields_are_the_models_and_named_ones_win(smol):
    for seed in range(3):
        assert ask(smol, seed) == ask(smol, seed, **CARD_VALUES)  # unset = the card's values, drawn the same
    plain = [ask(smol, seed, temperature=1.0, top_p=1.0) for seed in range(3)]
    assert plain != [ask(smol, seed) for seed in range(3)]  # a named value wins over the default
    assert ask(smol, 5, temperature=0) == ask(smol, 6, temperature=0) == "The capital of France is Paris."


def test_python_api_takes_the_defaults_where_the_caller_named_none(smollm2):
    assert smollm2.sampling_defaults == SamplingDefaults(**SMOL_CARD)
    engine = Engine(smollm2)
    prompt = smollm2.encode_chat(FRANCE)
    gen = engine.generate(prompt, kvtool.SamplingParams(max_tokens=16, seed=1)).run()
    assert (gen.params.temperature, gen.params.top_p, gen.params.top_k) == (0.2, 0.9, 0)
    named = engine.generate(prompt, kvtool.SamplingParams(max_tokens=16, seed=1, **CARD_VALUES)).run()
    assert gen.text == named.text
    mine = engine.generate(prompt, {"max_tokens": 4, "seed": 1, "temperature": 0.9, "top_k": 3}).run()
    assert (mine.params.temperature, mine.params.top_k, mine.params.top_p) == (0.9, 3, 0.9)


@pytest.mark.parametrize("setting, source", [("auto", "model card: SmolLM2-135M-Instruct"), ("none", "none")])
def test_cli_generate_applies_the_generation_config_flag(monkeypatch, capsys, smollm2, setting, source):
    import kvtool.cli.generate as generate
    from kvtool.cli import main

    def load(args):  # the session's model, with the defaults the flag gives (kvtool.load reads them the same way)
        return dataclasses.replace(smollm2, sampling_defaults=sampling_defaults(
            smollm2.folder, smollm2.name, args.generation_config))

    monkeypatch.setattr(generate, "load_from_args", load)
    text = {}
    for name, extra in (("unset", []), ("named", ["--temperature", "0.2", "--top-p", "0.9"]),
                        ("plain", ["--temperature", "1", "--top-p", "1"])):
        assert main(["generate", "What is the capital of France?", "--chat", "--seed", "2", "--max-tokens", "16",
                     "--generation-config", setting, *extra]) == 0
        text[name] = capsys.readouterr().out
    assert text["unset"] == text["named" if setting == "auto" else "plain"] and text["named"] != text["plain"]
    assert load(type("Args", (), {"generation_config": setting})).sampling_defaults.source == source
