"""benchmarks/skills_repair.py: the per-repair arithmetic (token shares, means, the fidelity bar, the cheapest
repair that meets it) on hand-made numbers; no model. The benchmark itself runs kvtool.skills.evaluate, which the
skill-block tests exercise on real models."""

from __future__ import annotations

import pytest

from tests.bench.conftest import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("skills_repair")


def _row(repair, recomputed, agree=True, kl=0.01, identical=True, prompt=1000, prefix=100, blocks=850, extra=0.0):
    runs = prompt - prefix - blocks  # 50 tokens of Skill calls and question
    return {"repair": repair, "label": repair, "prompt_tokens": prompt, "prefix_tokens": prefix,
            "block_tokens": blocks, "recomputed_tokens": recomputed, "computed_tokens": runs + recomputed,
            "extra_token_equivalents": extra, "first_token_agree": agree, "kl_top20_next": kl, "kl_next": 2 * kl,
            "kl_mean": 3 * kl, "top1": 1.0 if identical else 0.5, "greedy_identical": identical,
            "greedy_match_tokens": 32 if identical else 4, "speedup_cold": 10.0}


def test_shares_and_means_are_taken_over_every_request_of_a_repair(bench):
    rows = [_row("none", 0, kl=0.02), _row("none", 0, kl=0.04, identical=False, prompt=2000, blocks=1850),
            _row("first_k", 10), _row("first_k", 30, prompt=2000, blocks=1850, extra=5)]
    none, first = bench.summarise(rows)
    assert none["repair"] == "none" and none["requests"] == 2 and none["prompt_tokens"] == 3000
    # not computed: the prefix (a prefix-cache hit) and the blocks; computed: 50 run tokens a request
    assert none["uncomputed_share"] == pytest.approx(2900 / 3000)
    assert none["kl_top20_mean"] == pytest.approx(0.03) and none["kl_top20_max"] == pytest.approx(0.04)
    assert none["greedy_identical"] == 0.5 and none["recomputed_block_share"] == 0
    assert first["uncomputed_share"] == pytest.approx((3000 - 100 - 40) / 3000)
    assert first["recomputed_block_share"] == pytest.approx(40 / 2700)
    assert first["computed_token_layers"] == pytest.approx((100 + 40 + 5) / 3000)


def test_the_bar_needs_all_three_figures(bench):
    good = [_row("r", 0) for _ in range(10)]
    assert bench.summarise(good)[0]["meets_bar"]
    one_first_token_off = good[:-1] + [_row("r", 0, agree=False)]  # 0.9 < 0.98
    assert not bench.summarise(one_first_token_off)[0]["meets_bar"]
    kl_high = [_row("r", 0, kl=0.06) for _ in range(10)]
    assert not bench.summarise(kl_high)[0]["meets_bar"]
    eight_of_ten = good[:8] + [_row("r", 0, identical=False) for _ in range(2)]  # exactly the 80 %
    assert bench.summarise(eight_of_ten)[0]["meets_bar"]
    seven_of_ten = good[:7] + [_row("r", 0, identical=False) for _ in range(3)]
    assert not bench.summarise(seven_of_ten)[0]["meets_bar"]


def test_the_cheapest_repair_meeting_the_bar_leaves_the_most_tokens_uncomputed(bench):
    rows = [_row("none", 0, identical=False), _row("first_k 4", 4), _row("first_k 32", 32),
            _row("attended", 4, extra=25)]
    summary = bench.summarise(rows)
    assert [s["meets_bar"] for s in summary] == [False, True, True, True]
    assert bench.cheapest(summary) == "first_k 4"  # ties on tokens go to the one with less extra compute
    assert bench.cheapest(bench.summarise(rows[:1])) is None


def test_knobs_and_labels_are_read_from_repair_specs(bench):
    assert bench._knob("recompute_deviation:ratio=0.1,layer=3,score=kv,first=0", "layer", 1) == 3
    assert bench._knob("none", "layer", 1) == 1
    assert bench.short_label("recompute_attended:ratio=0.01") == "attended 0.01"
    assert bench.short_label("recompute_first_k:k=4") == "first_k 4"
    assert bench.short_label("recompute_deviation") == "deviation"


def test_request_rows_count_the_runs_and_each_repairs_extra_pass(bench):
    q = {"greedy_match_tokens": 0, "kl_top20_next": 0.1, "kl_next": 0.2, "kl_mean": 0.3, "top1": 0.0, "misses": 3,
         "near_tie_misses": 1, "greedy_exact": False}
    record = {"prompt_tokens": 1000, "prefix_tokens": 100, "block_tokens": 800, "query_tokens": 30, "repairs": [
        {"repair": "recompute_deviation:ratio=0.1,layer=1,score=kv,first=0", "strategy": "recompute_deviation",
         "recomputed_tokens": 80, "per_query": [q], "speedup_cold": 2.0},
        {"repair": "recompute_attended:ratio=0.01,window=64,score=attention_v", "strategy": "recompute_attended",
         "recomputed_tokens": 8, "per_query": [q], "speedup_cold": 5.0}]}
    deviation, attended = bench.request_rows(record, num_layers=20)
    assert deviation["computed_tokens"] == 100 + 80 and deviation["extra_token_equivalents"] == 800 * 2 / 20
    assert attended["computed_tokens"] == 108 and attended["extra_token_equivalents"] == 30
    assert not attended["first_token_agree"] and not attended["greedy_identical"] and attended["near_tie_misses"] == 1


def test_top20_kl_is_taken_over_the_references_top_tokens_renormalised():
    import math

    import torch

    from kvtool.skills.evaluate import TOP_K, fidelity

    ref = torch.zeros(1, 100)
    ref[0, :TOP_K] = 5.0  # the reference's top 20: uniform, far above the rest
    tail_moved = ref.clone()
    tail_moved[0, TOP_K:] = 4.0  # only tokens outside the top 20 change
    m = fidelity(ref, tail_moved, [0])
    assert m["kl_top20_next"] == pytest.approx(0, abs=1e-6) and m["kl_next"] > 0.1
    skewed = ref.clone()
    skewed[0, 0] = 5.0 + math.log(2)  # token 0 twice as likely as each other top token: q = 2/21, 1/21, ...
    p, q0, q = 1 / 20, 2 / 21, 1 / 21
    m = fidelity(ref, skewed, [0])
    assert m["kl_top20_next"] == pytest.approx(p * math.log(p / q0) + 19 * p * math.log(p / q), rel=1e-4)
    assert m["kl_top20_mean"] == pytest.approx(m["kl_top20_next"])
