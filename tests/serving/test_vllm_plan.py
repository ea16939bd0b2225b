"""kvtool.engines.vllm.plan: what the connector supplies for a request, over plain token ids (no vLLM, no model)."""

from __future__ import annotations

from kvtool.engines.vllm.plan import plan_request
from kvtool.skills.match import BlockIndex

A, B = list(range(100, 140)), list(range(200, 230))  # two blocks: 40 and 30 tokens


def index():
    idx = BlockIndex()
    idx.add("a", A)
    idx.add("b", B)
    return idx


PROMPT = [1, 2, 3] + A + [4, 5] + B + [6, 7, 8]  # blocks at [3, 43) and [45, 75); 78 tokens


def test_blocks_after_the_hit_are_supplied_with_the_text_between_them():
    plan = plan_request(PROMPT, 0, 0, index().find)
    assert plan.path == "splice" and plan.cut == 0 and plan.ready == 75 and plan.supplied == 75
    assert plan.segments == [("ids", [1, 2, 3]), ("block", "a"), ("ids", [4, 5]), ("block", "b")]


def test_a_query_guided_repair_runs_to_the_last_token_which_vllm_computes():
    plan = plan_request(PROMPT, 0, 0, index().find, query_guided=True)
    assert plan.ready == len(PROMPT) - 1 and plan.segments[-1] == ("ids", [6, 7])


def test_vllm_hit_inside_a_block_restarts_the_composition_at_the_block():
    plan = plan_request(PROMPT, 16, 0, index().find)  # vLLM holds 16 tokens: a's first 13
    assert plan.cut == 3 and plan.local == 16 and plan.supplied == 75 - 16
    assert plan.segments[0] == ("block", "a")


def test_short_blocks_are_left_to_the_prefill():
    plan = plan_request(PROMPT, 0, 0, index().find, min_block_tokens=35)
    assert plan.block_names == ["a"] and plan.skipped == ["b"] and plan.ready == 43


def test_the_store_supplies_what_it_holds_beyond_vllm():
    plain = list(range(1000, 1100))
    plan = plan_request(plain, 32, 96, index().find)
    assert plan.path == "stored" and plan.ready == 96 and plan.supplied == 64
    assert plan_request(plain, 0, 100, index().find).ready == 99  # never the last token
    assert plan_request(plain, 64, 48, index().find).path == "prefill"


def test_nothing_to_supply_when_vllm_holds_the_blocks():
    plan = plan_request(PROMPT, 77, 0, index().find)
    assert plan.path == "prefill" and plan.supplied == 0
