"""compose() on a tiny random model: relocation exactness, full recompute == full prefill, repair knobs."""

import dataclasses

import pytest
import torch

from kvtool.cache.kv import KVCache
from kvtool.cache.store import BlockPool
from kvtool.errors import ContextWindowError, InvalidParameterError
from kvtool.skills import compose, compose_segments, make_repair
from kvtool.skills.repair import REPAIRS, describe

from .conftest import rand_ids

PREFIX, SUFFIX = rand_ids(11, 10), rand_ids(6, 11)


def full(tiny, blocks, prefix=PREFIX, suffix=SUFFIX):
    seq = prefix + [t for b in blocks for t in b.token_ids] + suffix
    cache = tiny.new_cache(len(seq) + 1)
    return cache, tiny.prefill(seq, cache, logits="all")


@pytest.mark.parametrize("repair", ["recompute_first_k:k=1000", "recompute_deviation:ratio=1.0",
                                    "recompute_attended:ratio=1.0"])
def test_recomputing_everything_equals_full_prefill(tiny, tiny_blocks, repair):
    ref_cache, ref = full(tiny, tiny_blocks)
    out = compose(tiny, PREFIX, tiny_blocks, SUFFIX, repair=repair, logits="all")
    assert out.recomputed_tokens == out.block_tokens == sum(len(b) for b in tiny_blocks)
    assert (out.logits - ref[-len(SUFFIX):]).abs().max().item() < 1e-4
    k1, v1 = ref_cache.stacked()
    k2, v2 = out.cache.stacked()
    assert (k1 - k2).abs().max().item() < 1e-4 and (v1 - v2).abs().max().item() < 1e-4


def test_first_k_recompute_is_prefill_for_the_recomputed_tokens(tiny, tiny_blocks):
    block = tiny_blocks[0]
    out = compose(tiny, PREFIX, [block], [], repair="recompute_first_k:k=4")
    ref = tiny.new_cache()
    tiny.prefill(PREFIX + block.token_ids[:4], ref)
    assert torch.allclose(out.cache.stacked(0, len(PREFIX) + 4)[0], ref.stacked()[0], atol=1e-5)


def test_first_k_places_consecutive_blocks_in_one_pass_as_one_by_one(tiny, tiny_blocks):
    from kvtool.skills.repair import RecomputeFirstK

    repair = RecomputeFirstK(k=3)
    together = compose(tiny, PREFIX, tiny_blocks, SUFFIX, repair=repair, logits="all")
    alone = tiny.new_cache()
    tiny.prefill(PREFIX, alone)
    for block in tiny_blocks:  # place() one block at a time
        repair.place(tiny, alone, block)
    logits = tiny.prefill(SUFFIX, alone, logits="all")
    assert together.recomputed_tokens == 3 * len(tiny_blocks) and len(tiny_blocks) > 1
    assert (together.logits - logits).abs().max().item() < 1e-4
    assert (together.cache.stacked()[0] - alone.stacked()[0]).abs().max().item() < 1e-5


def test_first_k_computes_the_runs_between_blocks_in_the_same_pass_as_a_prefill_would(tiny, tiny_blocks):
    from kvtool.skills.repair import RecomputeFirstK

    repair, (a, b), gap = RecomputeFirstK(k=3), tiny_blocks, rand_ids(5, 12)
    together = compose_segments(tiny, [PREFIX, a, gap, b, SUFFIX], repair, logits="all")
    alone = tiny.new_cache()
    tiny.prefill(PREFIX, alone)
    repair.place(tiny, alone, a)  # block by block, the run prefilled after the repaired block
    tiny.prefill(gap, alone)
    repair.place(tiny, alone, b)
    logits = tiny.prefill(SUFFIX, alone, logits="all")
    assert together.prefilled_tokens == len(PREFIX) + len(gap) + len(SUFFIX) and together.recomputed_tokens == 6
    assert [(p.name, p.start) for p in together.placements] == [("alpha", 11), ("beta", 11 + len(a) + len(gap))]
    assert (together.logits - logits).abs().max().item() < 1e-4
    for x, y in zip(together.cache.stacked(), alone.stacked()):  # keys, then values: the run's KV included
        assert (x - y).abs().max().item() < 1e-5


def run_by_run(tiny, segments, repair):
    """The composition a segment at a time: runs prefilled, blocks placed by repair.place()."""
    cache, logits = tiny.new_cache(), None
    for seg in segments:
        if isinstance(seg, list):
            logits = tiny.prefill(seg, cache, logits="all")
        else:
            repair.place(tiny, cache, seg)
    return cache, logits


@pytest.mark.parametrize("repair,chunk", [("none", 512), ("none", 4), ("recompute_first_k:k=3", 5)])
def test_one_pass_equals_prefilling_run_by_run(tiny, tiny_blocks, repair, chunk):
    (a, b), gap = tiny_blocks, rand_ids(5, 12)
    segments = [PREFIX, a, gap, b, SUFFIX]
    repair = make_repair(repair)
    together = compose_segments(tiny, segments, repair, logits="all", chunk=chunk)
    alone, logits = run_by_run(tiny, segments, repair)
    assert together.prefilled_tokens == len(PREFIX) + len(gap) + len(SUFFIX)
    assert together.logits.shape == (len(SUFFIX), tiny.spec.vocab_size)
    assert (together.logits - logits).abs().max().item() < 1e-4
    for x, y in zip(together.cache.stacked(), alone.stacked()):  # keys, then values: every run's KV included
        assert (x - y).abs().max().item() < 1e-5


def test_one_pass_passes_over_the_model_once(tiny, tiny_blocks, monkeypatch):
    """A skill-loading context (prefix, then a run before each block, then the query) is one pass when the
    chunk holds every run token; the runner's own prefill is not called."""
    from kvtool.skills import selective

    passes = []
    embed = tiny.model.embed_tokens.forward
    monkeypatch.setattr(tiny.model.embed_tokens, "forward", lambda ids: passes.append(ids.numel()) or embed(ids))
    (a, b), gap = tiny_blocks, rand_ids(5, 12)
    out = compose_segments(tiny, [PREFIX, a, gap, b, SUFFIX], "none")
    assert passes == [len(PREFIX) + len(gap) + len(SUFFIX)] and out.logits.shape == (1, tiny.spec.vocab_size)
    passes.clear()
    compose_segments(tiny, [PREFIX, a, gap, b, SUFFIX], "none", chunk=8)
    assert passes == [8, 8, 6] and len(PREFIX) + len(gap) + len(SUFFIX) == 22
    with pytest.raises(ValueError, match="ascending"):
        selective.recompute_slots(tiny, out.cache, [5, 3], [1, 2])


def test_attended_places_the_runs_before_its_query_in_one_pass_as_run_by_run(tiny, tiny_blocks):
    (a, b), gap = tiny_blocks, rand_ids(5, 12)
    repair = make_repair("recompute_attended:ratio=0.3,window=4")
    together = compose_segments(tiny, [PREFIX, a, gap, b, SUFFIX], repair, logits="all")
    alone, _ = run_by_run(tiny, [PREFIX, a, gap, b], repair)
    placed = [(p, blk) for p, blk in zip(together.placements, (a, b))]
    logits = repair.repair_run(tiny, alone, [(type(p)(p.name, p.start, p.tokens), blk) for p, blk in placed],
                               SUFFIX, 512, "all")
    assert together.recomputed_tokens == int(0.3 * (len(a) + len(b)))
    assert (together.logits - logits).abs().max().item() < 1e-4


def test_query_groups_split_the_active_tokens_into_runs_that_stop_at_their_last_position():
    from kvtool.skills.selective import query_groups

    assert query_groups([3, 4, 10, 11, 20, 21, 30, 31]) == [(0, 2, 5), (2, 4, 12), (4, 6, 22), (6, 8, 32)]
    assert query_groups([7, 2, 9], groups=2) == [(0, 2, 8), (2, 3, 10)]  # any order: a run ends at its largest
    assert query_groups([5], groups=4) == [(0, 1, 6)] and query_groups([]) == []
    assert query_groups(list(range(10)), groups=1) == [(0, 10, 10)]


@pytest.mark.parametrize("groups", [2, 3, 8])
@pytest.mark.parametrize("repair", ["recompute_first_k:k=3", "recompute_deviation:ratio=0.5"])
def test_grouped_attention_recomputes_the_same_kv_as_one_call_over_the_whole_cache(tiny, tiny_blocks, monkeypatch,
                                                                                   groups, repair):
    """Each run of query_groups() attends only up to its last position; the KV equals one masked call's."""
    from kvtool.skills import selective

    out = {}
    for g in (1, groups):
        monkeypatch.setattr(selective.query_groups, "__defaults__", (g,))
        out[g] = compose(tiny, PREFIX, tiny_blocks, SUFFIX, repair=repair, logits="all")
    for a, b in zip(out[1].cache.stacked(), out[groups].cache.stacked()):
        assert (a - b).abs().max().item() < 1e-5
    assert (out[1].logits - out[groups].logits).abs().max().item() < 1e-4
    assert out[1].recomputed_tokens == out[groups].recomputed_tokens > 0


def test_no_repair_places_relocated_keys_layer0_exact(tiny, tiny_blocks):
    ref_cache, ref = full(tiny, tiny_blocks)
    out = compose(tiny, PREFIX, tiny_blocks, SUFFIX, repair="none")
    assert out.cache.offset == ref_cache.offset and out.reused_tokens == out.block_tokens
    lo, hi = len(PREFIX), len(PREFIX) + out.block_tokens
    k_ref, v_ref = ref_cache.stacked(lo, hi)
    k, v = out.cache.stacked(lo, hi)
    # layer 0 KV does not depend on context: relocation reproduces it; deeper layers differ (no context)
    assert (k[0] - k_ref[0]).abs().max().item() < 1e-4 * k_ref.abs().max().item()
    assert (v[0] - v_ref[0]).abs().max().item() < 1e-5
    assert (k[1:] - k_ref[1:]).abs().max().item() > 1e-3
    assert torch.allclose(out.cache.stacked(0, lo)[0], ref_cache.stacked(0, lo)[0], atol=1e-5)  # plain prefill


def test_deviation_repair_selects_the_requested_share(tiny, tiny_blocks):
    n = sum(len(b) for b in tiny_blocks)
    counts = {}
    for ratio in (0.0, 0.1, 0.5):
        out = compose(tiny, PREFIX, tiny_blocks, SUFFIX, repair=f"recompute_deviation:ratio={ratio}")
        counts[ratio] = out.recomputed_tokens
        assert out.cache.offset == len(PREFIX) + n + len(SUFFIX)
    assert counts == {0.0: 0, 0.1: 3 + 3, 0.5: 15 + 12}


def test_deviation_scores_and_forced_first_tokens(tiny, tiny_blocks):
    from kvtool.cache.kv import KVCache
    from kvtool.skills.repair import append_relocated
    from kvtool.skills.selective import SCORES, recompute_selected

    block = tiny_blocks[0]
    for score in SCORES:
        cache = tiny.new_cache()
        tiny.prefill(PREFIX, cache)
        append_relocated(tiny, cache, block)
        res = recompute_selected(tiny, cache, block.token_ids, len(PREFIX), 0.2, 1, score=score, first=4)
        assert len(res.selected) == 6 and res.selected[:4] == [0, 1, 2, 3] and res.deviation.shape == (len(block),)
        assert isinstance(cache, KVCache) and cache.offset == len(PREFIX) + len(block)


@pytest.mark.parametrize("score", ["attention", "attention_v"])
def test_attended_recomputes_the_block_tokens_the_query_attends_to_most(tiny, tiny_blocks, score):
    from kvtool.skills.selective import attention_received

    n = sum(len(b) for b in tiny_blocks)
    plain = compose(tiny, PREFIX, tiny_blocks, [], repair="none").cache
    received = attention_received(tiny, plain.clone(), SUFFIX, window=4, chunk=3, values=score == "attention_v")
    assert received.shape == (len(PREFIX) + n,) and received.sum() > 0
    lo = len(PREFIX)
    expected = sorted((lo + received[lo:].topk(int(0.3 * n)).indices).tolist())
    out = compose(tiny, PREFIX, tiny_blocks, SUFFIX, repair=f"recompute_attended:ratio=0.3,window=4,score={score}")
    assert out.recomputed_tokens == int(0.3 * n) == len(expected)
    assert [p.recomputed for p in out.placements] == [sum(lo <= s < lo + len(tiny_blocks[0]) for s in expected),
                                                       sum(s >= lo + len(tiny_blocks[0]) for s in expected)]
    k_none, _ = plain.stacked(0, lo + n)
    k_out, _ = out.cache.stacked(0, lo + n)
    changed = ((k_out[1:] - k_none[1:]).abs().amax((0, 1, 3)) > 1e-6).nonzero().flatten().tolist()
    assert changed == expected  # exactly the most attended block tokens got fresh KV (layer 0 never changes)
    _, ref = full(tiny, tiny_blocks)
    assert (out.logits - ref[-1:]).abs().max() < (compose(tiny, PREFIX, tiny_blocks, SUFFIX).logits - ref[-1:]).abs().max()


def test_attended_without_a_query_after_the_blocks_recomputes_nothing(tiny, tiny_blocks):
    out = compose_segments(tiny, [PREFIX, *tiny_blocks], "recompute_attended:ratio=0.5")
    assert out.recomputed_tokens == 0 and out.logits is None
    a, b = tiny_blocks  # only the last token run after the blocks is the query; the gap is prefilled as usual
    out = compose_segments(tiny, [PREFIX, a, [5, 6, 7], b, SUFFIX], "recompute_attended:ratio=0.5")
    assert out.recomputed_tokens == int(0.5 * (len(a) + len(b))) and out.prefilled_tokens == len(PREFIX) + 3 + 6


def test_more_recompute_gets_closer_to_full(tiny, tiny_blocks):
    _, ref = full(tiny, tiny_blocks)
    err = {}
    for repair in ("none", "recompute_deviation:ratio=0.5", "recompute_first_k:k=1000"):
        out = compose(tiny, PREFIX, tiny_blocks, SUFFIX, repair=repair)
        err[repair] = (out.logits - ref[-1:]).abs().max().item()
    assert err["recompute_first_k:k=1000"] < 1e-4 < err["none"]
    assert err["recompute_deviation:ratio=0.5"] < err["none"]


def test_gaps_and_existing_cache(tiny, tiny_blocks):
    a, b = tiny_blocks
    start = tiny.new_cache()
    tiny.prefill(PREFIX, start)
    out = compose_segments(tiny, [a, [5, 6, 7], b, SUFFIX], "none", cache=start)
    assert out.cache is start and out.prefilled_tokens == 3 + len(SUFFIX)
    assert [(p.name, p.start) for p in out.placements] == [("alpha", 11), ("beta", 11 + len(a) + 3)]
    assert out.stats()["block_tokens"] == len(a) + len(b)


def test_positions_beyond_the_context_window(tiny, tiny_blocks):
    window = tiny.spec.max_position  # 512 for the tiny config
    with pytest.raises(ContextWindowError, match=r"skill block 'alpha' would occupy positions 500\.\.529"):
        compose(tiny, [3] * 500, tiny_blocks, [4])
    with pytest.raises(ContextWindowError, match=f"context window is {window} positions"):
        compose(tiny, [3] * 10, tiny_blocks, [4] * window)


def test_repair_registry_and_parsing():
    assert set(REPAIRS) == {"none", "recompute_first_k", "recompute_deviation", "recompute_attended"}
    assert describe(make_repair("recompute_attended:ratio=0.2,window=16")) == \
        "recompute_attended:ratio=0.2,window=16,score=attention_v"
    r = make_repair("recompute_deviation:ratio=0.25,layer=2,score=v,first=3")
    assert (r.ratio, r.layer, r.score, r.first) == (0.25, 2, "v", 3)
    assert describe(r) == "recompute_deviation:ratio=0.25,layer=2,score=v,first=3"
    assert make_repair("recompute_first_k:k=8").k == 8 and describe(make_repair("none")) == "none"
    for bad, why in [("magic", "unknown repair strategy"), ("recompute_first_k:j=1", "has no knob 'j'"),
                     ("recompute_first_k:k=x", "not a number"), ("recompute_first_k:k=-1", "k must be"),
                     ("recompute_deviation:ratio=2", "ratio must be"), ("recompute_deviation:layer=0", "layer must"),
                     ("recompute_deviation:score=l1", "score must be one of"),
                     ("recompute_deviation:first=-2", "first must be"),
                     ("recompute_attended:ratio=-0.1", "ratio must be"), ("recompute_attended:window=0", "window must"),
                     ("recompute_attended:score=v", "score must be one of attention_v, attention")]:
        with pytest.raises(InvalidParameterError, match=why):
            make_repair(bad)
    with pytest.raises(InvalidParameterError, match="has no knob 'zz'"):
        make_repair("recompute_first_k", zz=1)
    with pytest.raises(InvalidParameterError, match="repair must be a strategy name .* or a repair object; got int"):
        make_repair(5)


@pytest.mark.parametrize("call,why", [
    (lambda t, b: compose(t, "text", b, SUFFIX), "prefix_tokens is str, not token ids"),
    (lambda t, b: compose(t, PREFIX, b, None), "suffix_tokens must be a list of token ids; got NoneType"),
    (lambda t, b: compose(t, PREFIX, b[0], SUFFIX), "blocks must be a list of SkillBlocks .*got SkillBlock"),
    (lambda t, b: compose(t, PREFIX, ["alpha"], SUFFIX), r"blocks\[0\] is a str, not a SkillBlock"),
    (lambda t, b: compose(t, PREFIX, b, SUFFIX, logits="first"), "logits must be one of last, all, none"),
    (lambda t, b: compose(t, PREFIX, b, SUFFIX, chunk=0), "chunk must be an integer >= 1 tokens, got 0"),
    (lambda t, b: compose(t, PREFIX, b, SUFFIX, repair="recompute_deviation:layer=3"),  # it was the last layer, 2
     r"recompute_deviation: layer 3 does not exist; the model has 3 layers \(0..2\)"),
    (lambda t, b: compose(t, PREFIX + [t.spec.vocab_size], b, SUFFIX), r"token ids must be in \[0, 256\)"),
    (lambda t, b: compose_segments(t, [PREFIX, b[0], [1.5]]), r"segment 2 \(a token run\) must hold integer "
                                                              "token ids; got 1.5"),
])
def test_compose_names_a_bad_argument(tiny, tiny_blocks, call, why):
    with pytest.raises(InvalidParameterError, match=why):
        call(tiny, tiny_blocks)


def test_evaluate_scores_several_queries(tiny, tiny_blocks):
    from kvtool.skills.evaluate import EvalCase, evaluate, ttft_scaling

    case = EvalCase(PREFIX, list(tiny_blocks), SUFFIX, [rand_ids(5, 30), rand_ids(7, 31)])
    rec = evaluate(tiny, case, ["none", "recompute_first_k:k=1000"], n_greedy=6, repeats=1, log=lambda m: None)
    none, exact = rec["repairs"]
    assert rec["queries_scored"] == 3 and len(rec["greedy_reference"]) == 3 and len(none["per_query"]) == 3
    assert exact["top1"] == 1.0 and exact["greedy_exact_rate"] == 1.0 and exact["kl_next"] < 1e-6
    assert exact["cos_min"] > 0.99999 and 0 <= none["top1"] <= 1 and none["recomputed_fraction"] == 0
    assert exact["misses"] == 0 and none["misses"] == round((1 - none["top1"]) * 6 * 3)
    assert exact["ttft_ms_cold"]["n"] == 1 and exact["ttft_ms_warm_prefix"]["cpu_median"] >= 0
    rows = ttft_scaling(tiny, case, [1, 2], ["none"], known_full={2: rec["ttft_ms_full"]}, log=lambda m: None)
    assert [r["block_tokens"] for r in rows] == [len(tiny_blocks[0]), case.block_tokens]
    assert rows[1]["ttft_ms_full"] is rec["ttft_ms_full"] and rows[0]["ttft_ms_none"]["median"] > 0


def test_fidelity_counts_near_tie_misses():
    import torch

    from kvtool.skills.evaluate import NEAR_TIE, fidelity

    ref = torch.tensor([[5.0, 0.0, 0.0], [1.0, 1.0 - NEAR_TIE / 2, 0.0], [0.0, 3.0, 0.0]])  # greedy 0, 0, 1
    comp = torch.tensor([[0.0, 5.0, 0.0], [0.0, 1.0, 0.0], [0.0, 3.0, 0.0]])  # misses steps 0 and 1
    m = fidelity(ref, comp, [0, 0, 1])
    assert m["misses"] == 2 and m["near_tie_misses"] == 1 and m["greedy_match_tokens"] == 0
    assert abs(m["top1"] - 1 / 3) < 1e-9


@pytest.mark.parametrize("repair", ["none", "recompute_first_k:k=2", "recompute_attended:ratio=0.3"])
def test_a_block_placed_again_at_a_position_reads_the_pool_blocks_kept_there(tiny, tiny_blocks, repair):
    """On paged caches the pool blocks a relocated block fills whole are kept per position: placed again at that
    position (after other tokens) it reads them by reference, and the composed KV is what relocating it anew gives;
    a repair that writes into such a block writes into a copy, so the kept blocks stay as relocation made them."""
    alpha = dataclasses.replace(tiny_blocks[0], placed={})  # (30 tokens: at 7, blocks 2..8 hold only its tokens)
    pool = BlockPool.for_runner(tiny, 4, 1 << 22)

    def run(prefix, paged=True):
        cache = KVCache.paged([], pool.take(), 0, 0, pool.take) if paged else None
        return compose_segments(tiny, [prefix, alpha, SUFFIX], repair, cache=cache, logits="none")

    one = run(rand_ids(7, 3))
    (kept,) = alpha.placed.values()
    pristine = [blk.clone() for blk in kept]  # [2, L, H, 4, D] each
    two, plain = run(rand_ids(7, 4)), run(rand_ids(7, 4), paged=False)
    assert [one.placements[0].shared, two.placements[0].shared, plain.placements[0].shared] == [0, 28, 0]
    same = [a is b for a, b in zip(two.cache.layers[0].blocks[3:9], kept[1:])]  # the cache stays paged
    assert len(same) == 6 and (all(same) or repair.startswith("recompute_attended"))  # (its recompute writes copies)
    for got, want in zip(two.cache.stacked(), plain.cache.stacked()):
        assert torch.allclose(got, want, atol=1e-6)
    assert all(map(torch.equal, kept, pristine)) and len(alpha.placed) == 1
    relocated = compose_segments(tiny, [rand_ids(7, 4), dataclasses.replace(alpha, placed={}), SUFFIX], "none",
                                 logits="none").cache.stacked(8, 36)  # what relocation alone puts there
    assert torch.allclose(torch.cat(kept, 3), torch.stack(relocated), atol=1e-6)
    assert run(rand_ids(9, 5)).placements[0].shared == 0 and len(alpha.placed) == 2  # another position
