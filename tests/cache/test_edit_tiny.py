"""kvtool.skills.edit on a tiny random model: each way against prefill, and refused edits leave the cache intact."""

import pytest
import torch

from kvtool.cache.manager import PrefixCache
from kvtool.skills.edit import EditInputError, apply_edit, budget_tokens, plan_edit
from kvtool.testing.tiny import tiny_checkpoint, tiny_runner


class IdsOnly:
    """The two calls plan_edit makes on a model for a token span given as ids."""

    def decode(self, ids):
        return " ".join(map(str, ids))

    def encode(self, text):
        return [int(t) for t in text.split()]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_edit")
    tiny_checkpoint("qwen2", folder)
    return tiny_runner("qwen2", folder)


CONTEXT = [int(t) for t in torch.randint(3, 250, (40,), generator=torch.Generator().manual_seed(1))]
QUESTION = [7, 8, 9, 10, 11]


def prefilled(runner, ids):
    cache = runner.new_cache(len(ids) + 16)
    runner.prefill(ids, cache, logits="none")
    return cache


def snapshot(cache):
    return {k: v.clone() for k, v in cache.state().items()}


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def edit_at(start=10, end=12, value=(200, 201)):
    return plan_edit(IdsOnly(), CONTEXT, (start, end), list(value), unit="tokens")


def test_field_only_makes_the_field_exact_and_keeps_every_other_token(tiny):
    old = prefilled(tiny, CONTEXT)
    edit = edit_at()
    ref = prefilled(tiny, edit.new_ids)
    out = apply_edit(tiny, old, edit, "field_only").cache
    for got, want, was in zip(out.layers, ref.layers, old.layers):
        assert torch.allclose(got.keys[:, :, 10:12], want.keys[:, :, 10:12], atol=1e-5)
        assert torch.equal(got.keys[:, :, :10], was.keys[:, :, :10])
        assert torch.equal(got.values[:, :, 12:], was.values[:, :, 12:])  # computed against the old value
    assert not torch.allclose(out.layers[-1].values[:, :, 12:], ref.layers[-1].values[:, :, 12:], atol=1e-4)


def test_a_field_at_the_end_of_the_context_needs_no_repair(tiny):
    edit = plan_edit(IdsOnly(), CONTEXT, (38, 40), [5, 6], unit="tokens")
    out = apply_edit(tiny, prefilled(tiny, CONTEXT), edit, "field_only", question=QUESTION)
    ref = apply_edit(tiny, prefilled(tiny, CONTEXT), edit, "full", question=QUESTION)
    assert torch.allclose(out.logits, ref.logits, atol=1e-4)


@pytest.mark.parametrize("way", ["recompute_deviation:ratio=1.0", "recompute_attended:ratio=1.0"])
def test_a_whole_budget_repair_is_a_full_recompute(tiny, way):
    edit = edit_at()
    out = apply_edit(tiny, prefilled(tiny, CONTEXT), edit, way, question=QUESTION)
    ref = apply_edit(tiny, prefilled(tiny, CONTEXT), edit, "full", question=QUESTION)
    assert out.recomputed == len(CONTEXT) - 10  # the field and everything after it
    assert torch.allclose(out.logits, ref.logits, atol=1e-4)


@pytest.mark.parametrize("strategy", ["recompute_deviation", "recompute_attended"])
def test_a_small_budget_recomputes_its_share_field_first(tiny, strategy):
    out = apply_edit(tiny, prefilled(tiny, CONTEXT), edit_at(), f"{strategy}:ratio=0.1", question=QUESTION)
    assert out.recomputed == budget_tokens(0.1, len(CONTEXT), 2) == 4
    assert budget_tokens(0.01, 40, 2) == 2 and budget_tokens(0.05, 40, 1) == 2 and budget_tokens(1.0, 40, 2) == 40


def test_the_erratum_keeps_the_cache_a_prefix(tiny):
    old = prefilled(tiny, CONTEXT)
    out = apply_edit(tiny, old, edit_at(), "erratum", erratum_ids=[30, 31, 32], question=QUESTION)
    ref = tiny.prefill(CONTEXT + [30, 31, 32] + QUESTION, tiny.new_cache(64))
    assert out.token_ids == CONTEXT + [30, 31, 32] and out.recomputed == 0 and out.appended == 3
    assert torch.allclose(out.logits, ref, atol=1e-4)


@pytest.mark.parametrize("way", ["full", "field_only", "erratum", "recompute_deviation:ratio=0.2",
                                 "recompute_attended:ratio=0.2"])
def test_no_way_changes_the_cache_it_is_given(tiny, way):
    old = prefilled(tiny, CONTEXT)
    before = snapshot(old)
    apply_edit(tiny, old, edit_at(), way, erratum_ids=[30, 31], question=QUESTION)
    assert same(before, snapshot(old))


@pytest.mark.parametrize("way", ["field_only", "erratum", "recompute_deviation:ratio=0.2",
                                 "recompute_attended:ratio=0.2"])
def test_an_edit_of_the_prefix_caches_kv_reads_its_blocks_in_place_and_copies_only_those_it_writes(tiny, way):
    """A paged cache (a prefix hit's): the edited copy shares every block before the field with the prefix cache,
    which stays as it was, and holds what an edit of a plain cache holds."""
    prefix = PrefixCache.for_runner(tiny, 1 << 22, block_size=4)
    prefix.pin(CONTEXT)
    paged, hit, handle = prefix.prepare(CONTEXT + [1], tiny)
    stored = prefix.store.tensors(handle.block_ids)
    before = [blk.clone() for blk in stored]
    out = apply_edit(tiny, paged, edit_at(), way, erratum_ids=[30, 31], question=QUESTION)
    ref = apply_edit(tiny, prefilled(tiny, CONTEXT), edit_at(), way, erratum_ids=[30, 31], question=QUESTION)
    assert hit == len(CONTEXT) and out.token_ids == ref.token_ids and out.recomputed == ref.recomputed
    assert torch.allclose(out.logits, ref.logits, atol=1e-4)
    assert all(map(torch.equal, stored, before))
    if way != "recompute_attended:ratio=0.2":  # (its measuring prefill runs the reference forward, which copies)
        first = out.cache.layers[0]
        assert first.page is not None and all(x is y for x, y in zip(first.blocks[:2], stored[:2]))
        assert (first.blocks[2] is stored[2]) == (way == "erratum")  # the block holding the field is written
    prefix.commit(handle, CONTEXT, paged)


@pytest.mark.parametrize("call, names", [
    (lambda r, c: apply_edit(r, c, plan_edit(IdsOnly(), CONTEXT, (10, 12), [1, 2, 3], unit="tokens"),
                             "field_only"), ["as many tokens", "erratum"]),
    (lambda r, c: apply_edit(r, c, plan_edit(IdsOnly(), CONTEXT, (10, 12), [1], unit="tokens"),
                             "recompute_deviation:ratio=0.1"), ["as many tokens", "erratum"]),
    (lambda r, c: plan_edit(IdsOnly(), CONTEXT, (30, 41), [1], unit="tokens"), ["outside the context", "40"]),
    (lambda r, c: plan_edit(IdsOnly(), CONTEXT, (5, 5), [1], unit="tokens"), ["outside the context"]),
    (lambda r, c: plan_edit(IdsOnly(), CONTEXT, (1, 2), [1], unit="lines"), ["unit"]),
    (lambda r, c: apply_edit(r, c, edit_at(), "recompute_first_k:k=4"), ["unknown edit way"]),
    (lambda r, c: apply_edit(r, c, edit_at(), "recompute_attended:ratio=0.1"), ["question"]),
    (lambda r, c: apply_edit(r, c, edit_at(), "erratum"), ["erratum"]),
    (lambda r, c: apply_edit(r, c, edit_at(), "recompute_deviation:ratio=2"), ["ratio"]),
    (lambda r, c: apply_edit(r, c, plan_edit(IdsOnly(), CONTEXT[:-1], (1, 2), [1], unit="tokens"), "field_only"),
     ["holds 40 tokens but the context has 39"]),
    (lambda r, c: apply_edit(r, c, plan_edit(IdsOnly(), CONTEXT[:-1] + [999], (1, 2), [1], unit="tokens"),
                             "field_only"), ["vocabulary", "999"]),
])
def test_bad_edits_are_refused_by_name_and_the_cache_stays_intact(tiny, call, names):
    old = prefilled(tiny, CONTEXT)
    before = snapshot(old)
    with pytest.raises(EditInputError) as err:
        call(tiny, old)
    assert all(n in str(err.value) for n in names), str(err.value)
    assert same(before, snapshot(old)) and old.offset == len(CONTEXT)


def test_a_cache_of_another_model_is_refused(tiny):
    foreign = prefilled(tiny, CONTEXT)
    foreign.layers = foreign.layers[:2]  # another depth: another model's KV
    with pytest.raises(EditInputError, match="another model: 2 layers"):
        apply_edit(tiny, foreign, edit_at(), "field_only")


def _row(case, way, agree, kl, mode="direct"):
    return {"case": case, "mode": mode, "way": way, "agree_text": agree, "agree_value": agree,
            "decision": "new" if agree else "old", "kl_next": kl, "top1": 1.0, "cos_mean": 1.0, "fraction": 0.1,
            "recomputed": 1, "appended": 0, "partial_equiv": 0.0, "ms": 2.0, "speedup": 1.5,
            "gap_closed": None if way == "unedited" else 1 - kl / 2.0}


def _record(cases, **over):
    from kvtool.bench.edit import summarize, verdict

    rows = [r for c in cases for r in (_row(c, "full", True, 0.0), _row(c, "unedited", c == "a", 2.0),
                                       _row(c, "field_only", False, 1.99), _row(c, "erratum", True, 0.1))]
    for r in rows:
        if r["way"] == "unedited":
            r["gap_closed"] = 0.0
    summary = summarize(rows)
    return {"model": "m", "dtype": "float32", "budgets": [0.1], "answer_tokens": 4, "reasoning_tokens": 4,
            "repeats": 0, "modes": ["direct"], "cases": len(cases), "rows": rows, "summary": summary,
            "verdict": verdict(rows, summary), **over}


def test_the_verdict_counts_the_cases_the_edit_changes_and_merging_recomputes_it():
    from kvtool.bench.edit import merge_records
    from kvtool.errors import InvalidParameterError

    merged = merge_records([_record(["a", "b"]), _record(["c"])])
    v = merged["verdict"]["direct"]
    assert merged["cases"] == 3 and v["edit_changes_answer"] == 2  # "a" kept its answer unedited
    assert v["field_only_recovers"] == 0.0 and v["erratum_recovers"] == 1.0 and v["claim_erratum_recovers"]
    assert v["field_only_gap_closed_median"] == pytest.approx(0.005) and v["claim_field_kv_under_1pct"]
    with pytest.raises(InvalidParameterError, match="share a case"):
        merge_records([_record(["a"]), _record(["a"])])
    with pytest.raises(InvalidParameterError, match="repeats"):
        merge_records([_record(["a"]), _record(["b"], repeats=1)])
