"""The batched sampler draws from the same distributions as each request's own Sampler."""

import pytest
import torch

from kvtool.config import SamplingParams
from kvtool.engine.batch_sampling import OFF, TOP_P_CANDIDATES, processed_logits, sample_rows, top_p_drop
from kvtool.engine.sampling import Sampler

V = 50
MIX = [dict(temperature=0.0), dict(temperature=0.7), dict(temperature=1.3, top_k=5),
       dict(temperature=1.0, top_p=0.8), dict(temperature=0.9, min_p=0.05),
       dict(temperature=1.1, top_k=12, min_p=0.02, top_p=0.9),
       dict(temperature=0.8, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2),
       dict(temperature=0.0, repetition_penalty=1.5), dict(temperature=1.0, top_k=V + 10),
       dict(temperature=0.9, logit_bias={4: 5.0, 9: -100.0}), dict(temperature=0.0, logit_bias={5: 30.0}),
       dict(temperature=1.0, min_tokens=10), dict(temperature=0.0, min_tokens=3)]


def samplers_for(mix, seen=(3, 7, 7, 11)):
    out = []
    for kw in mix:
        s = Sampler(SamplingParams(**kw).validate(), V, prompt_ids=[1, 2, 3], device=torch.device("cpu"))
        s.hold([0, 1])  # the stop tokens min_tokens holds back
        for t in seen:
            s.observe(t)
        out.append(s)
    return out


def reference_logits(s: Sampler, row: torch.Tensor) -> torch.Tensor:
    """What Sampler.__call__ draws from (greedy rows: the penalised logits it takes the argmax of)."""
    x = s._adjust(row.float())
    return x if s.p.greedy else s._truncate(x / s.p.temperature)


def test_processed_logits_equal_each_samplers_own():
    gen = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(len(MIX), V + 6, generator=gen)  # padded vocab, as models have
    samplers = samplers_for(MIX)
    got = processed_logits(samplers, logits)
    assert got.shape == (len(MIX), V)
    for i, s in enumerate(samplers):
        want = reference_logits(s, logits[i, :V])
        assert torch.equal(torch.isinf(got[i]), torch.isinf(want)), f"row {i} ({MIX[i]}) truncates differently"
        finite = torch.isfinite(want)
        assert torch.allclose(got[i][finite], want[finite], atol=1e-5), f"row {i} ({MIX[i]})"
    assert torch.isinf(got[2]).sum() == V - 5 and not torch.isinf(got[8]).any()
    assert got[10].argmax() == 5  # a bias of +30 takes greedy
    assert torch.isinf(got[11][:2]).all() and torch.isfinite(got[11][2:]).all()  # 4 observed < min_tokens 10
    assert torch.isfinite(got[12]).all()  # min_tokens 3 is reached: stop tokens are back


def test_draws_follow_the_truncated_distribution():
    torch.manual_seed(0)
    row = torch.randn(V) * 2
    for kw in (dict(temperature=0.8, top_p=0.9), dict(temperature=1.5, top_k=6), dict(temperature=1.0)):
        n = 20000
        samplers = samplers_for([kw] * n, seen=())
        want = torch.softmax(reference_logits(samplers[0], row), -1)
        tokens = torch.tensor([s.token for s in sample_rows(samplers, row.expand(n, V))])
        freq = torch.bincount(tokens, minlength=V).float() / n
        assert (freq - want).abs().max().item() < 0.015, kw
        assert freq[want == 0].sum().item() == 0, f"{kw}: drew a truncated token"


def test_greedy_rows_take_the_argmax_and_logprobs_come_back_with_the_tokens():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, V, generator=gen)
    mix = [dict(temperature=0.0), dict(temperature=0.0, logprobs=3), dict(temperature=0.9, logprobs=0),
           dict(temperature=0.0, repetition_penalty=2.0, logprobs=1)]
    samplers = samplers_for(mix, seen=(int(logits[3].argmax()),))
    out = sample_rows(samplers, logits)
    assert out[0].token == int(logits[0].argmax()) and out[0].logprob is None and out[0].top is None
    for i in (1, 3):  # greedy with logprobs: the same Sample as the request's own sampler
        alone = samplers_for([mix[i]], seen=(int(logits[3].argmax()),))[0](logits[i])
        assert out[i].token == alone.token and out[i].logprob == pytest.approx(alone.logprob, abs=1e-6)
        assert [t for t, _ in out[i].top] == [t for t, _ in alone.top]
        assert [v for _, v in out[i].top] == pytest.approx([v for _, v in alone.top], abs=1e-6)
    assert out[3].token != int(logits[3].argmax())  # the penalty moved it
    raw = torch.log_softmax(logits[2], -1)
    assert out[2].logprob == pytest.approx(raw[out[2].token].item(), abs=1e-6) and out[2].top is None


def test_bad_calls_are_refused():
    seeded = Sampler(SamplingParams(temperature=1.0, seed=3), V, [], torch.device("cpu"))
    with pytest.raises(ValueError, match="own generator"):
        sample_rows([seeded], torch.zeros(1, V))
    with pytest.raises(ValueError, match="2 samplers for 1 rows"):
        sample_rows(samplers_for(MIX[:2]), torch.zeros(1, V))


def test_top_p_looks_at_the_candidates_first_and_the_whole_vocabulary_when_they_fall_short():
    """Peaked rows keep a nucleus inside the first TOP_P_CANDIDATES tokens; a flat row does not, so the whole
    sorted vocabulary decides; a row with no top_p keeps everything. Each equals the full sort's truncation."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 8 * TOP_P_CANDIDATES, generator=gen) * 2
    x[:2, :40] += 10  # peaked: a nucleus of tens of tokens
    x[2] = torch.randn(8 * TOP_P_CANDIDATES, generator=gen) * 0.05  # flat: the nucleus is most of the row
    top_p = torch.tensor([[0.9], [0.5], [0.9], [OFF]])
    probs, order = torch.softmax(x, -1).sort(-1, descending=True)
    want = torch.zeros_like(x, dtype=torch.bool).scatter(1, order, probs.cumsum(-1) - probs >= top_p)
    assert torch.equal(top_p_drop(x, top_p), want)
    kept = (~want).sum(-1)
    assert kept[0] < 60 and kept[2] > TOP_P_CANDIDATES and kept[3] == x.shape[1]
    assert torch.equal(top_p_drop(x[:2], top_p[:2]), want[:2])  # the candidates alone
