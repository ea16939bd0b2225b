"""kvtool.integrations.vllm.plan: the prefix run the connector supplies for a request, over plain token ids (no vLLM, no
model): store blocks, the saved tail of the prefix's last block, then skill blocks back to back."""

from __future__ import annotations

from kvtool.integrations.vllm.plan import Piece, plan_request
from kvtool.skills.match import BlockIndex

A, B = list(range(100, 140)), list(range(200, 230))  # two blocks: 40 and 30 tokens
SYSTEM = list(range(1, 21))  # 20 tokens: one whole 16-token block and a 4-token tail
BS = 16


def index():
    idx = BlockIndex()
    idx.add("a", A)
    idx.add("b", B)
    return idx


PROMPT = SYSTEM + A + B + [6, 7, 8]  # a at [20, 60), b at [60, 90); 93 tokens


def tail_at(start, end):
    return lambda s, e: (s, e) == (start, end)


def test_adjacent_blocks_after_the_prefix_and_its_saved_tail_are_supplied():
    plan = plan_request(PROMPT, 16, 0, index().find, BS, tail_at(16, 20))
    assert plan.pieces == [Piece("tail", 16, 20), Piece("block", 20, 60, "a", 20), Piece("block", 60, 90, "b", 60)]
    assert plan.ready == 90 and plan.supplied == 74 and plan.block_tokens == 70 and plan.tail_at == 20
    assert plan.skill_path == "composed" and plan.path == "splice"


def test_without_the_tail_vllm_computes_the_text_before_the_first_block_and_the_blocks():
    plan = plan_request(PROMPT, 16, 0, index().find, BS)
    assert plan.supplied == 0 and plan.prefilled == ["a", "b"] and plan.skill_path == "prefilled"
    assert "the text before a has no KV until vLLM computes it" in plan.skill_reason
    assert plan.tail_at == 20  # so the save keeps the tail for the next request


def test_text_between_blocks_ends_the_run():
    prompt = SYSTEM + A + [4, 5] + B + [6]
    plan = plan_request(prompt, 16, 0, index().find, BS, tail_at(16, 20))
    assert plan.block_names == ["a"] and plan.prefilled == ["b"] and plan.ready == 60
    assert "b prefilled by vLLM" in plan.skill_reason


def test_a_hit_inside_a_block_supplies_the_rest_of_it():
    plan = plan_request(PROMPT, 32, 0, index().find, BS)  # vLLM holds 32 tokens: a's first 12
    assert plan.pieces[0] == Piece("block", 32, 60, "a", 20) and plan.ready == 90


def test_short_blocks_are_left_to_the_prefill():
    plan = plan_request(PROMPT, 16, 0, index().find, BS, tail_at(16, 20), min_block_tokens=35)
    assert plan.block_names == ["a"] and plan.skipped == ["b"] and plan.ready == 60


def test_the_store_supplies_what_it_holds_beyond_vllm():
    plan = plan_request(PROMPT, 16, 48, index().find, BS)  # the store holds 3 blocks: into a
    assert plan.pieces[:2] == [Piece("store", 16, 48), Piece("block", 48, 60, "a", 20)] and plan.ready == 90
    plain = plan_request(list(range(1, 70)), 0, 64, BlockIndex().find, BS)
    assert plain.pieces == [Piece("store", 0, 64)] and plain.path == "stored" and plain.skill_path == "prefilled"


def test_nothing_to_supply_when_vllm_holds_the_blocks_and_the_last_token_is_vllms():
    held = plan_request(PROMPT, 90, 0, index().find, BS)
    assert held.supplied == 0 and held.skill_path == "cached"
    ending = SYSTEM + A
    plan = plan_request(ending, 16, 0, index().find, BS, tail_at(16, 20))
    assert plan.ready == len(ending) - 1 and plan.pieces[-1] == Piece("block", 20, 59, "a", 20)


def test_a_stored_prefix_reaching_into_the_first_block_stops_at_it_so_the_block_is_spliced_whole():
    plan = plan_request(PROMPT, 0, 32, index().find, BS, tail_at(16, 20))  # the store holds [0, 32): a's first 12
    assert plan.pieces[:3] == [Piece("store", 0, 16), Piece("tail", 16, 20), Piece("block", 20, 60, "a", 20)]
    assert plan.block_tokens == 70
    kept = plan_request(PROMPT, 0, 32, index().find, BS)  # no tail saved: the stored tokens are used as they are
    assert kept.pieces[:2] == [Piece("store", 0, 32), Piece("block", 32, 60, "a", 20)]
