"""Sampling processors, parameter validation, stop strings and detokenization."""

import pytest
import torch

from kvtool.config import SamplingParams
from kvtool.engine.detok import StopStringMatcher
from kvtool.engine.sampling import Sampler
from kvtool.errors import InvalidParameterError


def sampler(**kw):
    return Sampler(SamplingParams(**kw).validate(), 8, [], torch.device("cpu"))


LOGITS = torch.tensor([0.0, 3.0, 2.5, 1.0, -1.0, 0.5, 2.9, -3.0])


def draws(s, n=300):
    return {s(LOGITS).token for _ in range(n)}


def test_greedy_takes_argmax():
    assert sampler(temperature=0).__call__(LOGITS).token == 1


def test_top_k_limits_support():
    assert draws(sampler(temperature=1.0, top_k=2, seed=0)) == {1, 6}


def test_top_p_keeps_the_smallest_nucleus():
    probs = torch.softmax(LOGITS, -1)
    # top-3 (ids 1, 6, 2) hold > 0.8 of the mass, the top-2 do not
    assert probs[[1, 6]].sum() < 0.8 < probs[[1, 6, 2]].sum()
    assert draws(sampler(temperature=1.0, top_p=0.8, seed=0)) == {1, 6, 2}


def test_min_p_drops_tokens_far_below_the_best():
    probs = torch.softmax(LOGITS, -1)
    allowed = {i for i in range(8) if probs[i] >= 0.3 * probs.max()}
    assert draws(sampler(temperature=1.0, min_p=0.3, seed=0)) == allowed


def test_seed_reproduces_and_differs():
    a = [sampler(temperature=1.0, seed=7)(LOGITS).token for _ in range(1)]
    s1, s2, s3 = sampler(temperature=1.0, seed=7), sampler(temperature=1.0, seed=7), sampler(temperature=1.0, seed=8)
    seq1 = [s1(LOGITS).token for _ in range(50)]
    assert seq1 == [s2(LOGITS).token for _ in range(50)]
    assert seq1 != [s3(LOGITS).token for _ in range(50)]
    assert a[0] == seq1[0]


def test_penalties_push_away_seen_tokens():
    s = sampler(temperature=0, presence_penalty=2.0, frequency_penalty=0.5)
    s.observe(1)
    assert s(LOGITS).token == 6  # 3.0 - 2.5 < 2.9
    r = Sampler(SamplingParams(temperature=0, repetition_penalty=1.5).validate(), 8, [1], torch.device("cpu"))
    assert r(LOGITS).token == 6  # 3.0 / 1.5 = 2.0 < 2.9


def test_logit_bias_moves_tokens_and_logprobs_stay_raw():
    s = sampler(temperature=0, logit_bias={4: 5.0}, logprobs=1)
    out = s(LOGITS)
    assert out.token == 4  # -1 + 5 beats 3.0
    assert out.logprob == pytest.approx(float(torch.log_softmax(LOGITS, -1)[4]))
    assert draws(sampler(temperature=1.0, seed=0, logit_bias={1: -100, 6: -100, 2: -100}, top_k=2)) == {3, 5}


def test_min_tokens_holds_stop_tokens_back_until_reached():
    s = sampler(temperature=0, min_tokens=2)
    s.hold([1, 6, 99])  # ids past the vocabulary are ignored
    assert s(LOGITS).token == 2
    s.observe(2)
    assert s(LOGITS).token == 2
    s.observe(2)
    assert s(LOGITS).token == 1  # two tokens out: the stop token may come
    free = sampler(temperature=0)
    free.hold([1])  # min_tokens 0 holds nothing
    assert free(LOGITS).token == 1


def test_logprobs_come_from_the_raw_distribution():
    s = sampler(temperature=0, logprobs=3)
    out = s(LOGITS)
    raw = torch.log_softmax(LOGITS, -1)
    assert out.logprob == pytest.approx(float(raw[1]))
    assert [t for t, _ in out.top] == [1, 6, 2]


@pytest.mark.parametrize("kw,name", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-3), "top_k"), (dict(min_p=2), "min_p"), (dict(max_tokens=0), "max_tokens"),
    (dict(presence_penalty=3), "presence_penalty"), (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(temperature=float("nan")), "temperature"), (dict(stop=[""]), "stop"), (dict(logprobs=50), "logprobs"),
    (dict(min_tokens=-1), "min_tokens"), (dict(min_tokens=9, max_tokens=8), "min_tokens"),
    (dict(min_tokens=2, response_format="json_object"), "min_tokens"), (dict(logit_bias={"7": 1.0}), "logit_bias"),
    (dict(logit_bias={7: 101}), "logit_bias"), (dict(logit_bias={7: float("nan")}), "logit_bias"),
    (dict(logit_bias=[7]), "logit_bias"),
])
def test_invalid_values_name_the_parameter(kw, name):
    with pytest.raises(InvalidParameterError, match=name):
        SamplingParams(**kw).validate()


def test_stop_string_is_held_back_then_cut():
    m = StopStringMatcher(["</end>"])
    shown = m.feed("Hello </e") + m.feed("n")
    assert shown == "Hello " and not m.stopped
    shown += m.feed("d> trailing")
    assert m.stopped and shown == "Hello " and m.text == "Hello "


def test_unarmed_matcher_lets_a_stop_string_through_but_holds_its_start():
    m = StopStringMatcher(["STOP", "\n"])
    out = m.feed("a\nb STOP", armed=False) + m.feed(" ST", armed=False)
    assert out == "a\nb STOP " and not m.stopped  # "ST" could still become a stop string
    out += m.feed("OP tail")  # armed: the match that ends in the new text counts
    assert m.stopped and out == "a\nb STOP " and m.text == "a\nb STOP "


def test_matcher_names_the_stop_string_and_can_keep_it():
    for include, want in ((False, "a b"), (True, "a b</x>")):
        m = StopStringMatcher(["</y>", "</x>"], include=include)
        out = m.feed("a b</") + m.feed("x> c</y>")
        assert m.stopped and m.matched == "</x>" and out == want and m.text == want


def test_false_start_of_stop_string_is_released():
    m = StopStringMatcher(["STOP"])
    out = m.feed("ST") + m.feed("ART and more")
    assert out == "START and more" and not m.stopped
    assert m.finish() == ""


def test_single_token_decodes_are_memoised_per_tokenizer():
    from kvtool.engine.detok import IncrementalDetokenizer, decode_piece

    class Counting:
        calls = 0

        def decode(self, ids, skip_special_tokens=False):
            Counting.calls += 1
            return "".join("<s>" if (i == 0 and not skip_special_tokens) else chr(96 + i) for i in ids if
                           i or not skip_special_tokens)

    tok = Counting()
    assert [decode_piece(tok, t) for t in (1, 2, 1, 1, 0)] == ["a", "b", "a", "a", "<s>"]
    assert Counting.calls == 3 and decode_piece(tok, 0, True) == "" and Counting.calls == 4
    d = IncrementalDetokenizer(tok)
    assert "".join(d.add(t) for t in (1, 2, 3, 0, 4)) + d.flush() == "abcd"
