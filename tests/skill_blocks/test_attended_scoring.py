"""recompute_attended's scoring (kvtool.skills.selective.receiver / attention_received) against plain references:
on random data, a full softmax per query head; on the real SmolLM2, a reference forward's tap over an unpaged cache
(how the scores were computed before they ran over a paged cache's blocks in place)."""

import math

import pytest
import torch

from kvtool.cache.kv import KVCache
from kvtool.engine import Engine
from kvtool.skills import compose_segments
from kvtool.skills.selective import attention_received, receiver

from .test_skills_real import catalog, cache_dir, conversation_ids, skills_dir  # noqa: F401 (fixtures)


class Attn:
    def __init__(self, window=None, scale=None):
        self.window, self.scale = window, scale


def reference(q, keys, vals, pos, start, first_row, window=None, values=False):
    """Each query head h over KV head h // group, one row at a time: softmax over the slots at or before the row's
    position (and inside the window), the probabilities of the slots before `start` summed."""
    hq, hkv, d = q.shape[1], keys.shape[1], keys.shape[3]
    out = torch.zeros(start, dtype=torch.float64)
    for h in range(hq):
        kv = h // (hq // hkv)
        for i, p in enumerate(pos.tolist()):
            if p < first_row:
                continue
            seen = torch.arange(p + 1)
            if window is not None:
                seen = seen[seen > p - window]
            probs = torch.softmax(keys[0, kv, seen].double() @ q[0, h, i].double() / math.sqrt(d), 0)
            got = torch.zeros(keys.shape[2], dtype=torch.float64).index_add_(0, seen, probs)[:start]
            out += got * vals[0, kv, :start].double().norm(dim=-1) if values else got
    return out


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("values", [False, True])
def test_receiver_equals_a_full_softmax_per_query_head(window, values, monkeypatch):
    g = torch.Generator().manual_seed(0)
    hq, hkv, d, end, start = 6, 2, 8, 40, 30
    q, keys, vals = (torch.randn(1, h, n, d, generator=g) for h, n in ((hq, 10), (hkv, end), (hkv, end)))
    pos = torch.arange(start, end)
    want = reference(q, keys, vals, pos, start, first_row=34, window=window, values=values)
    monkeypatch.setattr("kvtool.skills.selective.ROW_BUDGET_BYTES", 4 * hq * end * 3)  # 3 rows a block
    got = torch.zeros(start)
    receiver(got, 34, values)(Attn(window), q, keys, vals, pos)
    assert got.shape == want.shape and torch.allclose(got.double(), want, rtol=1e-5, atol=1e-6)
    assert got[: start - (window or end)].sum() == 0 if window else got.min() > 0


def reference_forward_received(runner, cache, ids, window, values):
    """The query prefilled by the reference forward (an unpaged cache), its tap scoring every query head."""
    start, spec = cache.offset, runner.spec
    received, group = torch.zeros(start, dtype=torch.float64), spec.num_heads // spec.num_kv_heads

    def tap(t):
        end, n = t.cache[t.layer].offset, t.q_rot.shape[2]
        keys = t.cache[t.layer].keys[0].double().repeat_interleave(group, 0)  # [Hq, end, D]
        for row in range(max(start + len(ids) - window, end - n), end):
            scores = t.q_rot[0, :, row - (end - n)].double()[:, None] @ keys[:, : row + 1].transpose(1, 2)
            probs = torch.softmax(scores[:, 0] / math.sqrt(spec.head_dim), -1)[:, :start]  # [Hq, start]
            norms = t.cache[t.layer].values[0, :, :start].double().norm(dim=-1).repeat_interleave(group, 0)
            received.add_((probs * norms if values else probs).sum(0))

    runner.prefill(ids, cache, chunk=4, logits="none", tap=tap)
    return received


@pytest.mark.real_model
def test_attended_scores_over_paged_blocks_pick_the_reference_forwards_tokens(smollm2, catalog):  # noqa: F811
    """SmolLM2, two skills spliced into a paged cache (the engine's pool): the scores, and the block tokens the
    repair picks at 10% and 25%, are the reference forward's."""
    ids, runner = conversation_ids(smollm2, catalog, "haiku", "limerick"), smollm2.runner
    segments, pos = [], 0
    for match, block in catalog.find(ids):
        segments += [ids[pos : match.start], block]
        pos = match.end
    query, blocks = ids[pos:], [s for s in segments if not isinstance(s, list)]
    first = segments[0]
    candidates = torch.cat([torch.arange(len(first), len(first) + len(blocks[0])),
                            torch.arange(pos - len(blocks[1]), pos)])
    pool = Engine(smollm2).pool
    for values, window in ((False, 4), (True, 16)):  # (the query has 11 tokens)
        paged = compose_segments(runner, segments, "none", cache=KVCache.paged([], pool.take(), 0, 0, pool.take),
                                 logits="none").cache
        plain = compose_segments(runner, segments, "none", logits="none").cache
        got = attention_received(runner, paged, query, window=window, chunk=2048, values=values)
        want = reference_forward_received(runner, plain, query, window, values)
        assert paged.layers[0].blocks and not plain.layers[0].blocks  # the scores were read over pool blocks
        assert (got.double() - want).abs().max() <= 1e-4 * want.max()
        for ratio in (0.1, 0.25):
            keep = int(ratio * len(candidates))
            assert set(candidates[got[candidates].topk(keep).indices].tolist()) == \
                set(candidates[want[candidates].topk(keep).indices].tolist())
