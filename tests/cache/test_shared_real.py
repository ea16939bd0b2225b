"""Two engines on one block store (EngineConfig.kv_store) with the real SmolLM2: the second answers a long prompt
the first one saw from the store, with the greedy tokens of a cold engine; on a folder and on a Redis server."""

from __future__ import annotations

import pytest

from kvtool import SamplingParams
from kvtool.cache.manager import attach_prefix_cache
from kvtool.config import EngineConfig
from kvtool.engine import Engine
from tests.cache.test_prefix_real import SYSTEM, chat_ids
from tests.cache.test_redisstore import SERVER

pytestmark = pytest.mark.real_model

GREEDY = SamplingParams(temperature=0, max_tokens=8)
LONG = " ".join([SYSTEM] * 12)  # a long system prompt: ~650 tokens


def engine_on(model, location: str) -> Engine:
    engine = Engine(model, EngineConfig(kv_store=location, cache_bytes=64 << 20))
    attach_prefix_cache(engine)
    return engine


@pytest.mark.parametrize("backend", ["folder", "redis"])
def test_a_second_engine_answers_a_long_prompt_from_the_store(smollm2, tmp_path, backend, request):
    if backend == "redis":
        if SERVER is None:
            pytest.skip("no redis-server or valkey-server")
        location = request.getfixturevalue("redis_url") + "/15"
    else:
        location = str(tmp_path / "store")
    prompt = chat_ids(smollm2, "Which breads do you bake on Saturdays?", system=LONG)
    assert len(prompt) > 500
    cold = Engine(smollm2).generate(prompt, GREEDY).run()  # no prefix cache at all
    first = engine_on(smollm2, location)
    got = first.generate(prompt, GREEDY).run()
    assert got.timings.cached_tokens == 0 and got.token_ids == cold.token_ids
    first.prefix_cache.shared.flush()
    assert first.prefix_cache.stats()["store_written_blocks"] >= len(prompt) // 16
    second = engine_on(smollm2, location)
    again = second.generate(prompt, GREEDY).run()
    assert again.timings.cached_tokens >= 0.9 * len(prompt), (again.timings.cached_tokens, len(prompt))
    assert again.token_ids == cold.token_ids
    stats = second.prefix_cache.stats()
    assert stats["store_hit_tokens"] == again.timings.cached_tokens and stats["store_bad_blocks"] == 0
    second.prefix_cache.check_integrity()
    second.prefix_cache.shared.store.check_integrity()


from tests.cache.test_redisstore import redis_url  # noqa: E402,F401  (the fixture, for the redis case)
