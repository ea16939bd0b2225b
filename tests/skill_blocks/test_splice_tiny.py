"""SkillSplicer (the engine's prefix_cache hook) on a tiny model: what prepare() hands the engine."""

import dataclasses

import pytest
import torch

from kvtool.cache.manager import PrefixCache
from kvtool.skills import SkillCatalog, SkillSplicer, compose_segments
from kvtool.skills.skillfile import Skill

from .conftest import rand_ids


def catalog_of(blocks):
    catalog = SkillCatalog(blocks[0].setup)
    for b in blocks:
        catalog.add(Skill(b.name, f"{b.name} skill", "body"), b)
    return catalog


P, G, T = rand_ids(9, 20), rand_ids(4, 21), rand_ids(5, 22)


class FakePrefixCache:
    """Serves a fixed-length hit computed by real prefill; records commits."""

    def __init__(self, hit):
        self.hit, self.commits = hit, []

    def prepare(self, prompt_ids, runner):
        cache = runner.new_cache(len(prompt_ids) + 8)
        runner.prefill(prompt_ids[: self.hit], cache)
        return cache, self.hit, ("inner-handle", self.hit)

    def publish(self, handle, token_ids, cache):
        pass  # a fixed hit: nothing to share

    def commit(self, handle, token_ids, cache):
        self.commits.append((handle, list(token_ids), cache.offset))


def test_prepare_splices_blocks_and_stops_after_the_last(tiny, tiny_blocks):
    a, b = tiny_blocks
    prompt = P + a.token_ids + G + b.token_ids + T
    splicer = SkillSplicer(catalog_of(tiny_blocks), repair="none")
    cache, ready, handle = splicer.prepare(prompt, tiny)
    assert ready == cache.offset == len(P) + len(a) + len(G) + len(b)
    s = handle.stats
    assert handle.block_tokens == s.block_tokens == len(a) + len(b) and s.gap_tokens == len(P) + len(G)
    assert s.prefix_hit_tokens == 0 and s.ready_tokens == ready and splicer.last_stats is s
    assert [x["name"] for x in s.blocks] == ["alpha", "beta"] and s.reused_block_tokens == s.block_tokens
    ref = compose_segments(tiny, [P, a, G, b], "none", logits="none").cache
    assert torch.allclose(cache.stacked()[0], ref.stacked()[0], atol=1e-6)
    splicer.commit(handle, prompt, cache)  # no inner hook: a no-op


def test_prompt_without_blocks_is_left_to_the_engine(tiny, tiny_blocks):
    splicer = SkillSplicer(catalog_of(tiny_blocks))
    prompt = P + tiny_blocks[0].token_ids[:-1] + T  # a partial block is not a block
    cache, ready, handle = splicer.prepare(prompt, tiny)
    assert ready == 0 and cache.offset == 0 and handle.block_tokens == 0


def test_wraps_inner_prefix_cache_and_commits_through(tiny, tiny_blocks):
    a, b = tiny_blocks
    prompt = P + a.token_ids + G + b.token_ids + T
    inner = FakePrefixCache(hit=len(P) + 3)  # the hit ends inside block alpha
    splicer = SkillSplicer(catalog_of(tiny_blocks), repair="recompute_first_k:k=2", inner=inner)
    cache, ready, handle = splicer.prepare(prompt, tiny)
    assert handle.stats.prefix_hit_tokens == len(P)  # truncated to the block start: the block is spliced whole
    assert handle.stats.block_tokens == len(a) + len(b) and handle.stats.recomputed_block_tokens == 4
    assert ready == cache.offset == len(prompt) - len(T)
    splicer.commit(handle, prompt[:ready], cache)
    assert inner.commits == [(("inner-handle", len(P) + 3), prompt[:ready], ready)]

    inner = FakePrefixCache(hit=len(P) + len(a) + 1)  # the hit covers alpha: only beta is spliced
    cache, ready, handle = SkillSplicer(catalog_of(tiny_blocks), inner=inner).prepare(prompt, tiny)
    assert handle.stats.prefix_hit_tokens == len(P) + len(a) + 1
    assert [x["name"] for x in handle.stats.blocks] == ["beta"] and handle.stats.gap_tokens == len(G) - 1
    assert ready == cache.offset == len(prompt) - len(T)


def test_catalog_lookup_helpers(tiny_blocks):
    catalog = catalog_of(tiny_blocks)
    assert catalog.names() == ["alpha", "beta"] and len(catalog) == 2 and "alpha" in catalog
    assert catalog.listing() == "- alpha: alpha skill\n- beta: beta skill"
    found = catalog.find(P + tiny_blocks[1].token_ids)
    assert [(m.name, m.start) for m, _ in found] == [("beta", len(P))]
    import pytest

    with pytest.raises(KeyError, match="known: alpha, beta"):
        catalog.block("gamma")


@pytest.mark.parametrize("repair", ["none", "recompute_first_k:k=2"])
@pytest.mark.parametrize("pinned", [8, 16])  # the hit ends before block alpha, or inside it (cut back to its start)
def test_blocks_spliced_after_a_prefix_hit_are_written_into_the_pool_and_kept_by_reference(tiny, tiny_blocks, repair,
                                                                                         pinned):
    """Over the prefix cache's paged KV the splice writes the gap and the relocated blocks through the request's
    block table: the hit's blocks stay the cache's own tensors (read in place, unchanged), the composed KV is that of
    a plain cache, and commit keeps the blocks the splice filled (those the cache did not hold) without a copy."""
    a, b = tiny_blocks
    prompt = P + a.token_ids + G + b.token_ids + T
    prefix = PrefixCache.for_runner(tiny, 1 << 22, block_size=4)
    prefix.pin(prompt[:pinned])
    held = prefix.store.tensors(prefix.index.match(prompt[:8], record=False))
    kept = [blk.clone() for blk in held]
    cache, ready, handle = SkillSplicer(catalog_of(tiny_blocks), repair, inner=prefix).prepare(prompt, tiny)
    first = cache.layers[0]
    hit = min(pinned, len(P))
    assert handle.stats.prefix_hit_tokens == hit and ready == cache.offset == len(prompt) - len(T)
    assert first.page is not None and all(layer.page is first.page for layer in cache.layers)
    assert all(x is y for x, y in zip(first.blocks[:2], held)) and all(map(torch.equal, held, kept))
    ref = tiny.new_cache(len(prompt))
    tiny.prefill(prompt[:hit], ref, logits="none")
    compose_segments(tiny, [P[hit:], a, G, b], repair, cache=ref, logits="none")
    assert torch.allclose(cache.stacked()[0], ref.stacked()[0], atol=1e-6)
    assert torch.allclose(cache.stacked()[1], ref.stacked()[1], atol=1e-6)
    prefix.commit(handle.inner, prompt[:ready], cache)
    stored = prefix.store.tensors(prefix.index.match(prompt[:ready], record=False))
    assert len(stored) == ready // 4 and all(x is y for x, y in list(zip(stored, first.blocks))[pinned // 4 :])
    prefix.check_integrity()


def test_requests_placing_a_block_at_one_position_share_its_pool_blocks_and_decode_as_without(tiny, tiny_blocks):
    """Through an Engine with a prefix cache: a second conversation of another first turn, as long, places both
    blocks where the first did and reads their kept pool blocks; its tokens are those of blocks relocated anew, and
    the prefix cache, which keeps such a block under both conversations' chains, stays consistent."""
    from kvtool import SamplingParams
    from kvtool.cache.manager import attach_prefix_cache
    from kvtool.engine import Engine
    from tests.cache.test_manager import TinyModel

    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    def engine():
        blocks = [dataclasses.replace(x, placed={}) for x in tiny_blocks]
        out = Engine(TinyModel(tiny))
        prefix = attach_prefix_cache(out, budget_bytes=1 << 22, block_size=4)
        out.prefix_cache = SkillSplicer(catalog_of(blocks), "none", inner=prefix)
        return out, prefix

    a, b = tiny_blocks
    prompts = [rand_ids(9, seed) + a.token_ids + G + b.token_ids + T for seed in (30, 31)]
    shared, prefix = engine()
    runs = [shared.generate(p, greedy).run().token_ids for p in prompts]
    assert [x["shared"] for x in shared.prefix_cache.last_stats.blocks] == [24, 20]  # whole blocks at 12.., 44..
    assert runs == [engine()[0].generate(p, greedy).run().token_ids for p in prompts]  # each relocated anew
    prefix.check_integrity()
