"""JSON mode: the incremental JSON check against json.loads, the token constraint, and SmolLM2 answering in it."""

import json
import random

import pytest

from kvtool import SamplingParams
from kvtool.structured.json_mode import MAX_NUMBER, MAX_WS, JsonConstraint, JsonState, advance


def random_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(7 if depth < 3 else 4)
    if kind == 0:
        return rng.choice([True, False, None])
    if kind == 1:
        return rng.choice([0, -3, 12345, 0.5, -2.25e-7, 1e21])
    if kind == 2:
        return "".join(rng.choice('ab "\\/\n\té€😀\x01') for _ in range(rng.randrange(6)))
    if kind == 3:
        return rng.randrange(10)
    if kind in (4, 5):
        return {f"k{i}": random_value(rng, depth + 1) for i in range(rng.randrange(4))}
    return [random_value(rng, depth + 1) for _ in range(rng.randrange(4))]


def test_every_prefix_of_a_json_object_is_accepted_and_only_the_whole_is_done():
    rng = random.Random(0)
    for i in range(300):
        obj = {f"f{j}": random_value(rng) for j in range(rng.randrange(4))}
        text = json.dumps(obj, indent=[None, 2][i % 2], ensure_ascii=bool(i % 3))
        state = JsonState()
        for j, ch in enumerate(text):
            assert not state.done, text[:j]
            state = advance(state, ch)
            assert state is not None, (text, j)
        assert state.done and advance(state, " ") is None and advance(state, "{") is None


def test_whatever_it_calls_done_parses_as_a_json_object():
    rng = random.Random(1)
    chars = '{}[]",:0123456789.-+eE truefalsnl\\u/'
    finished = 0
    for _ in range(30000):
        state, text = JsonState(), ""
        for _ in range(rng.randrange(1, 40)):
            nxt = advance(state, c := rng.choice(chars))
            if nxt is not None:
                state, text = nxt, text + c
            if state.done:
                assert isinstance(json.loads(text), dict), text
                finished += 1
                break
    assert finished > 1000


@pytest.mark.parametrize("text", ['[1]', '"x"', '{"a" 1}', '{"a": 01}', '{"a": 1.}', '{"a": tru}', '{"a": 1,}',
                                  '{,}', '{"a": "\x01"}', '{"a": 1.e5}', '{"a": -}', '{"a": "\\x"}', "{'a': 1}",
                                  '{"a": 1}}', '{' + ' ' * (MAX_WS + 1), '{"a": ' + '9' * (MAX_NUMBER + 1)])
def test_not_an_object_prefix(text):
    assert advance(JsonState(), text) is None


def test_a_number_may_be_as_long_as_max_number():
    assert advance(JsonState(), '{"a": ' + '9' * MAX_NUMBER + '}').done
    assert advance(JsonState(), '{"a": -1.2345678901234567e-308}').done


def test_constraint_allows_stops_only_at_the_end_and_never_other_special_tokens():
    pieces = ['{', '"a', '":', ' 1', '}', '<|im_end|>', '<|im_start|>', '\ufffd', ' "', 'x']
    c = JsonConstraint(pieces, special_ids={5, 6}, stop_ids={5})
    assert c.next_state(5) is None and c.next_state(6) is None and c.next_state(7) is None
    for token in (0, 1):
        c.accept(token)
    assert c.next_state(7) is not None  # inside a string: part of a multi-byte character
    for token in (2, 3):
        c.accept(token)
    assert c.next_state(7) is None and c.next_state(6) is None
    c.accept(4)
    assert c.state.done and c.next_state(5) is not None and c.next_state(8) is None
    with pytest.raises(ValueError, match="does not continue"):
        c.accept(9)


def test_a_suffix_is_spelled_after_the_object_before_the_turn_ends():
    pieces = ['{', '}', '\n', '</tool_call>', '</', 'tool_call>', '<|im_end|>', 'x']
    c = JsonConstraint(pieces, special_ids={6}, stop_ids={6}, suffix="\n</tool_call>")
    c.accept(0)
    c.accept(1)
    assert c.state.done and not c.finished
    assert [t for t in range(8) if c.next_state(t) is not None] == [2]  # only the suffix's start
    c.accept(2)
    assert [t for t in range(8) if c.next_state(t) is not None] == [3, 4]
    c.accept(4)
    c.accept(5)
    assert c.finished and [t for t in range(8) if c.next_state(t) is not None] == [6]


@pytest.mark.real_model
def test_smollm2_answers_with_one_json_object(smollm2):
    from kvtool.engine import Engine

    engine = Engine(smollm2)
    prompt = smollm2.encode(smollm2.render(
        [{"role": "user", "content": "Describe a cat as JSON with fields name, age and colour."}]))
    free = engine.generate(prompt, SamplingParams(temperature=0, max_tokens=64)).run()
    with pytest.raises(json.JSONDecodeError):
        json.loads(free.text)  # left alone, it fences the object in Markdown and talks on
    greedy = engine.generate(prompt, SamplingParams(temperature=0, max_tokens=64, response_format="json_object")).run()
    assert greedy.finish_reason == "stop" and set(json.loads(greedy.text)) >= {"name", "age"}
    params = SamplingParams(temperature=0.9, seed=3, max_tokens=96, response_format="json_object")
    sampled = engine.generate_batch([prompt], params, n=3)  # drawn alone, each as its own seeded run
    for i, gen in enumerate(sampled):
        assert gen.token_ids == engine.generate(prompt, SamplingParams(
            temperature=0.9, seed=3 + i, max_tokens=96, response_format="json_object")).run().token_ids
        if gen.finish_reason == "stop":
            assert isinstance(json.loads(gen.text), dict)
        else:  # cut at max_tokens: still a prefix of an object
            assert advance(JsonState(), gen.text.replace("\ufffd", "")) is not None
