"""logit_bias (OpenAI), and min_tokens, stop_reason and include_stop_str_in_output (vLLM) on a live server with
the real SmolLM2, alone and batched."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

pytestmark = pytest.mark.real_model

PROMPT = "The capital of France is"
HI = [{"role": "user", "content": "Say hi."}]


def complete(client, **body):
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 6, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def token_ids(client, text: str) -> list[int]:
    return client.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]


def test_a_banned_token_never_comes_and_a_boosted_one_always_does(smol):
    free = complete(smol, logprobs=1)
    first = free["choices"][0]["logprobs"]["tokens"][0]
    (paris,) = token_ids(smol, first)
    banned = complete(smol, logit_bias={str(paris): -100}, logprobs=0)["choices"][0]
    assert banned["logprobs"]["tokens"][0] != first and paris not in token_ids(smol, banned["text"])
    (dot,) = token_ids(smol, ".")
    boosted = complete(smol, logit_bias={str(dot): 100}, logprobs=0)["choices"][0]
    assert boosted["text"] == "." * 6
    # logprobs stay those of the model: the biased choice keeps its raw, low probability
    assert boosted["logprobs"]["token_logprobs"][0] < free["choices"][0]["logprobs"]["token_logprobs"][0] - 1


def test_batched_requests_each_keep_their_own_bias(smol):
    (paris,) = token_ids(smol, " Paris")
    (dot,) = token_ids(smol, ".")
    (the,) = token_ids(smol, " the")
    biases = [{}, {str(paris): -100}, {str(dot): 100}, {str(paris): -100, str(the): -100}]
    alone = [complete(smol, logit_bias=b)["choices"][0]["text"] for b in biases]
    with ThreadPoolExecutor(len(biases)) as pool:
        together = list(pool.map(lambda b: complete(smol, logit_bias=b, max_tokens=6)["choices"][0]["text"],
                                 biases * 2))
    assert together == alone * 2
    assert len(set(alone)) == len(alone)


def test_min_tokens_holds_the_end_of_turn_and_stop_strings(smol):
    def chat(**body):
        r = smol.post("/v1/chat/completions", json={"messages": HI, "temperature": 0, "max_tokens": 60, **body})
        assert r.status_code == 200, r.text
        return r.json()

    free = chat()
    short = free["usage"]["completion_tokens"]
    assert free["choices"][0]["finish_reason"] == "stop" and short < 30
    held = chat(min_tokens=30)
    assert held["usage"]["completion_tokens"] >= 30
    assert held["choices"][0]["message"]["content"].startswith(free["choices"][0]["message"]["content"])
    cut = chat(stop=["!"])["choices"][0]["message"]["content"]
    assert "!" not in cut and free["choices"][0]["message"]["content"].startswith(cut + "!")
    late = chat(stop=["!"], min_tokens=len(token_ids(smol, cut)) + 2)["choices"][0]["message"]["content"]
    assert late.startswith(cut + "!")  # the "!" came before min_tokens: it did not stop the answer


def test_stop_reason_names_what_stopped_the_text_and_the_stop_can_stay_in_it(smol, sse_events):
    def chat(**body):
        r = smol.post("/v1/chat/completions", json={"messages": HI, "temperature": 0, "max_tokens": 60, **body})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    free = chat()
    assert free["finish_reason"] == "stop" and free["stop_reason"] is None  # the end of turn
    answer = free["message"]["content"]
    cut = chat(stop=["!", "zzz"])
    assert cut["stop_reason"] == "!" and answer.startswith(cut["message"]["content"] + "!")
    kept = chat(stop=["!"], include_stop_str_in_output=True)
    assert kept["stop_reason"] == "!" and kept["message"]["content"] == cut["message"]["content"] + "!"
    long = chat(max_tokens=3)
    assert long["finish_reason"] == "length" and long["stop_reason"] is None

    first = complete(smol, max_tokens=8)["choices"][0]["text"]  # " Paris.\n\nThe answer"
    (dot,) = token_ids(smol, ".")
    by_id = complete(smol, max_tokens=8, stop_token_ids=[dot])["choices"][0]
    assert by_id["stop_reason"] == dot and by_id["text"] == first[: first.index(".")]
    with_id = complete(smol, max_tokens=8, stop_token_ids=[dot], include_stop_str_in_output=True)["choices"][0]
    assert with_id["stop_reason"] == dot and with_id["text"] == first[: first.index(".") + 1]

    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stop": ["\n"], "stream": True}
    with smol.stream("POST", "/v1/completions", json=body) as r:
        ends = [c["choices"][0] for c in sse_events(r) if c != "[DONE]" and c["choices"]][-1]
    assert ends["finish_reason"] == "stop" and ends["stop_reason"] == "\n"
    with smol.stream("POST", "/v1/chat/completions/raw", json={"messages": HI, "temperature": 0, "max_tokens": 60,
                                                               "stop": ["!"]}) as r:
        summary = [e for e in sse_events(r) if e != "[DONE]"][-1]
    assert summary["done"] and summary["stop_reason"] == "!"


@pytest.mark.parametrize("body,needle", [
    (dict(logit_bias={"Paris": 3}), "logit_bias"),
    (dict(logit_bias={"10000000": 3}), "logit_bias"),
    (dict(logit_bias={"5": 300}), "logit_bias"),
    (dict(min_tokens=9, max_tokens=4), "min_tokens"),
    (dict(min_tokens=-2), "min_tokens"),
])
def test_bad_values_are_refused_by_name(smol, body, needle):
    r = smol.post("/v1/completions", json={"prompt": PROMPT, **body})
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    assert complete(smol)["choices"][0]["text"]  # the server goes on


def test_guided_choice_and_allowed_token_ids(smol):
    r = smol.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Is fire cold?"}],
                                                "guided_choice": ["yes", "no"], "n": 3, "temperature": 1.0,
                                                "seed": 1, "max_tokens": 8})
    assert r.status_code == 200, r.text
    assert all(c["message"]["content"] in ("yes", "no") and c["finish_reason"] == "stop" for c in r.json()["choices"])
    allowed = token_ids(smol, " A") + token_ids(smol, " B")
    out = complete(smol, allowed_token_ids=allowed, temperature=1.0, seed=3, max_tokens=5)["choices"][0]["text"]
    assert token_ids(smol, out) and set(token_ids(smol, out)) <= set(allowed) and len(token_ids(smol, out)) == 5
    bad = smol.post("/v1/completions", json={"prompt": PROMPT, "guided_choice": ["a"],
                                             "response_format": {"type": "json_object"}})
    assert bad.status_code == 400 and "choice" in bad.json()["error"]["message"]
