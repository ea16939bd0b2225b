"""Two engines on one small block store (a tiny random Qwen3, so many workloads run): whatever the store evicted
and whichever engine computed a block, each answers with the greedy tokens of an engine without any cache, and
both caches and the store stay whole after every request."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtool import SamplingParams
from kvtool.cache.manager import attach_prefix_cache
from kvtool.cache.store import BlockPool
from kvtool.config import EngineConfig
from kvtool.engine import Engine
from tests.cache.test_manager import TinyModel, model  # noqa: F401  (the fixture)

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


class Named(TinyModel):
    """A TinyModel with the fingerprint a LoadedModel gives the store."""

    def fingerprint(self) -> dict:
        return {"model": "tiny-qwen3", "config_hash": self.runner.spec.config_hash(), "tokenizer_hash": "chars",
                "dtype": self.runner.precision}


def engine_on(model, root: str, store_blocks: int) -> Engine:
    """An engine whose cache holds 12 blocks, on a store at ``root`` that holds about ``store_blocks``."""
    per_block = BlockPool.for_runner(model.runner, 4).bytes_per_block
    engine = Engine(model, EngineConfig(prefill_chunk=16, prefix_block=4, kv_store=root,
                                        kv_store_bytes=store_blocks * (per_block + 2048)))  # (+ a record's header)
    attach_prefix_cache(engine, budget_bytes=12 * per_block, block_size=4)
    return engine


@pytest.mark.slow
@given(st.lists(st.tuples(st.integers(0, 1), st.integers(0, 2), st.integers(0, 10)), min_size=3, max_size=10),
       st.integers(3, 30))
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_engines_on_a_small_store_answer_as_an_engine_without_a_cache(model, tmp_path_factory, steps,
                                                                       store_blocks):
    tiny = Named(model.runner)
    root = str(tmp_path_factory.mktemp("store"))
    engines = [engine_on(tiny, root, store_blocks) for _ in range(2)]
    plain, memo = Engine(tiny, EngineConfig(prefill_chunk=16)), {}
    roots = [random.Random(seed).choices(range(1, 256), k=22) for seed in range(3)]
    seen, last = set(), None  # (engine, root) pairs run; the previous step's
    for who, r, extra in steps:
        prompt = roots[r] + random.Random(extra).choices(range(1, 256), k=extra)
        if tuple(prompt) not in memo:
            memo[tuple(prompt)] = plain.generate(prompt, GREEDY).run().token_ids
        cache = engines[who].prefix_cache
        before = cache.stats()["store_hit_tokens"]
        assert engines[who].generate(prompt, GREEDY).run().token_ids == memo[tuple(prompt)]
        if store_blocks >= 12 and (who, r) not in seen and last == (1 - who, r):  # the other engine just wrote it
            assert cache.stats()["store_hit_tokens"] >= before + 20, "the root's blocks were not read from the store"
        seen.add((who, r))
        last = (who, r)
        cache.shared.flush()
        cache.check_integrity()
        cache.shared.store.check_integrity()
        usage, limit = cache.shared.store.usage(), cache.shared.store.limit_bytes
        assert usage["bytes"] <= limit + 2 * (limit // 16 + limit // store_blocks)
