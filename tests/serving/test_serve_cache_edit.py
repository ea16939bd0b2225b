"""POST /v1/cache/edit on the real SmolLM2 server: an edit of a pinned prefix is reused by the next request."""

import pytest

pytestmark = pytest.mark.real_model

SYSTEM = ("You are a weather assistant. User profile:\n- name: Ana\n- city: Beijing\n- units: metric\n"
          "Answer in one short sentence and always use the user's city.")
QUESTION = {"role": "user", "content": "Which city should the weather be fetched for?"}


def context(city="Beijing"):
    return [{"role": "system", "content": SYSTEM.replace("Beijing", city)}]


def ask(client, messages):
    r = client.post("/v1/chat/completions", json={"messages": messages, "temperature": 0, "max_tokens": 4})
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def pin(client):
    client.post("/v1/cache/reset")
    r = client.post("/v1/cache/pin", json={"messages": context()})
    assert r.status_code == 200, r.text
    return r.json()


def test_an_in_place_edit_is_served_from_the_cache(smol):
    pin(smol)
    r = smol.post("/v1/cache/edit", json={"messages": context(), "field": "Beijing", "new_value": "Shanghai",
                                          "way": "recompute_deviation:ratio=0.1"})
    assert r.status_code == 200, r.text
    edit = r.json()
    assert edit["field"]["old"] == "Beijing" and edit["recomputed_tokens"] >= 1
    assert 0 < edit["reused_tokens"] < edit["tokens"] and edit["pinned_tokens"] == edit["tokens"] // 16 * 16
    usage = ask(smol, context("Shanghai") + [QUESTION])
    # every full block of the edited context comes from the edit: none is computed again
    assert usage["prompt_tokens_details"]["cached_tokens"] >= edit["pinned_tokens"]


def test_an_erratum_keeps_the_prefix_and_adds_the_correction(smol):
    pinned = pin(smol)
    r = smol.post("/v1/cache/edit", json={"messages": context(), "field": "Beijing", "new_value": "Shanghai",
                                          "label": "the user's city"})
    assert r.status_code == 200, r.text
    edit = r.json()
    assert edit["way"] == "erratum" and edit["recomputed_tokens"] == 0 and edit["appended_tokens"] > 0
    assert edit["erratum"] == "Correction: the user's city is Shanghai, not Beijing."
    assert edit["tokens"] == pinned["tokens"] + edit["appended_tokens"]
    usage = ask(smol, context() + [{"role": "user", "content": edit["erratum"]}, QUESTION])
    assert usage["prompt_tokens_details"]["cached_tokens"] >= edit["pinned_tokens"] > pinned["pinned_tokens"]


@pytest.mark.parametrize("body, status, param, words", [
    ({"field": "Beijing", "new_value": "San Francisco de Quito", "way": "field_only"}, 400, "new_value",
     ["as many tokens", "erratum"]),
    ({"span": [0, 100000], "new_value": "x", "way": "field_only"}, 400, "span", ["outside the context"]),
    ({"field": "Paris", "new_value": "Rome"}, 400, "field", ["does not occur"]),
    ({"field": "Beijing", "new_value": "Shanghai", "way": "recompute_attended:ratio=0.1"}, 400, "way", ["question"]),
    ({"field": "Beijing", "new_value": "Shanghai", "way": "teleport"}, 400, "way", ["unknown edit way"]),
    ({"field": "Beijing"}, 400, "new_value", ["new_value"]),
    ({"field": "Beijing", "new_value": "Shanghai", "color": 1}, 400, "color", ["unknown field"]),
    ({"field": "Beijing", "span": [1, 2], "new_value": "Shanghai"}, 400, "field", ["exactly one"]),
])
def test_bad_edits_get_a_4xx_naming_the_problem_and_the_cache_stays_intact(smol, body, status, param, words):
    pin(smol)
    before = smol.get("/v1/cache").json()
    r = smol.post("/v1/cache/edit", json={"messages": context(), **body})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and all(w in error["message"] for w in words), error
    after = smol.get("/v1/cache").json()
    assert {k: after[k] for k in ("blocks", "pinned_blocks", "resets")} == \
        {k: before[k] for k in ("blocks", "pinned_blocks", "resets")}


def test_an_edit_of_a_prefix_that_is_not_cached_is_refused(smol):
    smol.post("/v1/cache/reset")
    r = smol.post("/v1/cache/edit", json={"messages": context(), "field": "Beijing", "new_value": "Shanghai"})
    assert r.status_code == 409 and "pin it" in r.json()["error"]["message"]
    other_model = smol.post("/v1/cache/edit", json={"token_ids": [10 ** 7], "span": [0, 1], "unit": "tokens",
                                                    "new_value": "x"})
    assert other_model.status_code == 400 and other_model.json()["error"]["param"] == "token_ids"
