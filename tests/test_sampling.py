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
