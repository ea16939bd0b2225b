"""PrefixCache on a tiny random model: token-identical greedy output, faults, budget, HTTP router,
and a long random workload against a real BlockStore with integrity checked after every step."""

from __future__ import annotations

import random
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtool import SamplingParams
from kvtool.cache.kv import KVCache
from kvtool.cache.manager import PrefixCache, attach_prefix_cache
from kvtool.cache.store import memory_split
from kvtool.config import EngineConfig, SamplingDefaults
from kvtool.engine import Engine
from kvtool.errors import InvalidParameterError, PrefixCacheWarning
from kvtool.testing.tiny import tiny_checkpoint, tiny_runner

BS = 4
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


class CharTokenizer:
    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(65 + t % 26) for t in ids)


class TinyModel:
    """What Engine needs from a LoadedModel."""

    sampling_defaults = SamplingDefaults()  # the plain ones: no generation config

    def __init__(self, runner):
        self.runner, self.tokenizer, self.context_window = runner, CharTokenizer(), 512

    def end_of_turn_ids(self):
        return [0]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-qwen3")
    tiny_checkpoint("qwen3", folder)
    return TinyModel(tiny_runner("qwen3", folder))


def cached_engine(model, budget=1 << 22):
    engine = Engine(model, EngineConfig(prefill_chunk=16))
    cache = attach_prefix_cache(engine, budget_bytes=budget, block_size=BS)
    return engine, cache


def rand_ids(n, seed):
    return random.Random(seed).choices(range(1, 256), k=n)


def test_greedy_output_is_identical_with_and_without_the_cache(model):
    plain = Engine(model, EngineConfig(prefill_chunk=16))
    engine, cache = cached_engine(model)
    base = rand_ids(64, 0)
    prompts = {"0%": rand_ids(64, 1), "50%": base[:32] + rand_ids(32, 2), "99%": base[:63] + [7], "100%": base}
    engine.generate(base, GREEDY).run()  # the earlier request the others share tokens with
    for share, prompt in prompts.items():
        want = plain.generate(prompt, GREEDY).run()
        got = engine.generate(prompt, GREEDY).run()
        assert got.token_ids == want.token_ids, share
        # prompt[:-1] up to the token where it leaves what is cached: full blocks, then a slice of the next
        expected = {"0%": 0, "50%": 32, "99%": 63, "100%": 63}[share]
        assert got.timings.cached_tokens == expected, share
        assert got.timings.prefill_tokens == len(prompt) - expected
        cache.check_integrity()
    # a follow-up turn reuses the KV written while decoding too
    turn = base + got.token_ids + [5, 6, 7]
    again = engine.generate(turn, GREEDY).run()
    assert again.timings.cached_tokens >= len(base) + len(got.token_ids) - BS
    assert again.token_ids == plain.generate(turn, GREEDY).run().token_ids
    s = cache.stats()
    assert s["queries"] == 6 and 0 < s["hit_rate"] < 1 and s["bytes_in_use"] == s["blocks"] * s["bytes_per_block"]


def test_gathered_kv_equals_recomputed_kv(model):
    runner = model.runner
    cache_mgr = PrefixCache.for_runner(runner, budget_bytes=1 << 22, block_size=BS)
    ids = rand_ids(20, 3)
    fresh = runner.new_cache()
    runner.prefill(ids, fresh)
    kv, n, handle = cache_mgr.prepare(ids, runner)
    assert n == 0
    cache_mgr.commit(handle, ids, fresh)
    kv, n, handle = cache_mgr.prepare(ids + [9], runner)
    assert n == 20 and kv.offset == 20
    for a, b in zip(kv.layers, fresh.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    kv.layers[0].keys.zero_()  # the request's copy is its own: the cache is untouched
    k, _ = cache_mgr.store.gather(handle.block_ids)
    assert torch.equal(k[0], fresh.layers[0].keys[0])
    cache_mgr.commit(handle, ids, kv)
    cache_mgr.commit(handle, ids, kv)  # a second commit of one handle is a no-op
    cache_mgr.check_integrity()


def test_a_prefix_ending_inside_a_block_is_reused_to_the_token_and_exact(model):
    runner = model.runner
    pc = PrefixCache.for_runner(runner, budget_bytes=1 << 22, block_size=BS)
    first = rand_ids(22, 5)
    done = runner.new_cache()
    runner.prefill(first, done, logits="none")
    pc.commit(pc.prepare(first, runner)[2], first, done)  # blocks 0-4 cached (20 tokens)
    prompt = first[:18] + rand_ids(6, 6)  # leaves the cached prefix at token 18, inside block 4
    kv, n, handle = pc.prepare(prompt, runner)
    assert n == 18 and kv.offset == 18 and len(handle.block_ids) == 5  # 4 blocks, then 2 tokens of the 5th
    tail = handle.block_ids[-1]
    assert pc.index.evict_lru(10) == [] and tail in pc.store.ids()  # held while the request reads it: never evicted
    cold = runner.new_cache()
    want = runner.prefill(prompt, cold)
    got = runner.prefill(prompt[n:], kv)
    assert torch.allclose(got, want, atol=1e-5) and torch.equal(got.argmax(-1), want.argmax(-1))
    assert torch.allclose(kv.stacked(0, 24)[0], cold.stacked(0, 24)[0], atol=1e-5)
    pc.commit(handle, prompt, kv)
    assert pc.index._refcount(tail) == 0 and pc.stats()["hit_tokens"] == 18
    pc.check_integrity()


def test_partial_reuse_keeps_greedy_tokens_on_one_request_and_in_a_batch(model):
    plain = Engine(model, EngineConfig(prefill_chunk=16))
    engine, cache = cached_engine(model)
    base = rand_ids(30, 7)
    engine.generate(base, GREEDY).run()
    prompts = [base[:n] + rand_ids(9, n) for n in (6, 13, 27)]  # each leaves the cache inside a block
    want = [plain.generate(p, GREEDY).run().token_ids for p in prompts]
    got = engine.generate(prompts[0], GREEDY).run()
    assert got.token_ids == want[0] and got.timings.cached_tokens == 6
    cache.reset()
    engine.generate(base, GREEDY).run()
    batch = engine.generate_batch(prompts, GREEDY)  # the continuous-batching path takes the same slices
    assert [g.token_ids for g in batch] == want
    assert [g.timings.cached_tokens for g in batch] == [6, 13, 27]
    cache.check_integrity()


def test_budget_smaller_than_a_request_runs_uncached_with_a_warning(model):
    plain = Engine(model, EngineConfig(prefill_chunk=16))
    engine, cache = cached_engine(model, budget=0)
    per_block = cache.store.bytes_per_block
    prompt = rand_ids(40, 4)
    with pytest.warns(PrefixCacheWarning, match="does not fit the cache budget"):
        got = engine.generate(prompt, GREEDY).run()
    assert got.token_ids == plain.generate(prompt, GREEDY).run().token_ids
    assert cache.stats()["bytes_in_use"] == 0
    cache.set_budget(3 * per_block)  # room for 3 of the 13 blocks: the rest is dropped, not an error
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrefixCacheWarning)  # warned once per cache, not per request
        again = engine.generate(prompt, GREEDY).run()
        assert again.token_ids == got.token_ids
        third = engine.generate(prompt, GREEDY).run()
    assert third.timings.cached_tokens == 3 * BS and third.token_ids == got.token_ids
    assert cache.stats()["bytes_in_use"] <= 3 * per_block and cache.stats()["over_budget"] == 3
    cache.check_integrity()


def test_reset_while_a_request_runs_leaves_it_correct(model):
    plain = Engine(model, EngineConfig(prefill_chunk=16))
    engine, cache = cached_engine(model)
    prefix = rand_ids(32, 5)
    engine.generate(prefix + [1, 2], GREEDY).run()
    prompt = prefix + [3, 4, 5]
    gen = engine.generate(prompt, GREEDY)
    it = iter(gen)
    first = [next(it).token_id for _ in range(3)]
    assert gen.timings.cached_tokens == 32
    assert cache.reset()["freed_blocks"] > 0
    cache.check_integrity()
    assert cache.stats()["blocks"] == 8, "the running request still holds its 8 prefix blocks"
    rest = [ev.token_id for ev in it]
    assert first + rest == plain.generate(prompt, GREEDY).run().token_ids
    assert cache.stats()["blocks"] == 0, "KV computed before the reset is not inserted after it"
    cache.check_integrity()
    after = engine.generate(prompt, GREEDY).run()
    assert after.timings.cached_tokens == 0 and after.token_ids == first + rest


def test_interleaved_generations_sharing_a_prefix_never_see_each_others_kv(model):
    plain = Engine(model, EngineConfig(prefill_chunk=16))
    engine, cache = cached_engine(model)
    prefix = rand_ids(48, 6)
    engine.generate(prefix + [1], GREEDY).run()
    a, b = prefix + rand_ids(9, 7), prefix + rand_ids(5, 8)
    ga, gb = engine.generate(a, GREEDY), engine.generate(b, GREEDY)
    ia, ib = iter(ga), iter(gb)
    out_a, out_b = [], []
    for _ in range(GREEDY.max_tokens):
        out_a.append(next(ia).token_id)
        out_b.append(next(ib).token_id)
    assert ga.timings.cached_tokens == gb.timings.cached_tokens == 48
    assert out_a == plain.generate(a, GREEDY).run().token_ids
    assert out_b == plain.generate(b, GREEDY).run().token_ids
    cache.check_integrity()


def test_abort_and_failing_prefill_release_their_hold(model):
    engine, cache = cached_engine(model)
    prompt = rand_ids(30, 9)
    gen = engine.generate(prompt, GREEDY)
    next(iter(gen))
    gen.close()  # client went away: the prompt's KV is still worth keeping
    assert gen.finish_reason == "abort"
    assert cache.stats()["blocks"] == 30 // BS
    cache.check_integrity()

    class Boom(RuntimeError):
        pass

    def broken_prefill(*args, **kwargs):
        raise Boom()

    model.runner.run = broken_prefill  # the scheduler's one forward: here, the suffix's prefill
    try:
        with pytest.raises(Boom):
            engine.generate(prompt + [1, 2, 3, 4, 5], GREEDY).run()
    finally:
        del model.runner.run
    assert all(b.refcount == 0 for b in cache.index._blocks.values())
    cache.check_integrity()


def test_pin_survives_pressure_and_unpin_releases(model):
    engine, cache = cached_engine(model)
    cache.set_budget(12 * cache.store.bytes_per_block)
    system = rand_ids(22, 10)
    assert cache.pin(system) == {"tokens": 22, "pinned_tokens": 20, "unpinned_tail_tokens": 2}
    for seed in range(8):  # unrelated traffic that would evict an unpinned prefix
        engine.generate(rand_ids(29, 100 + seed), SamplingParams(temperature=0, max_tokens=2)).run()
        cache.check_integrity()
    assert cache.stats()["evictions"] > 0 and cache.stats()["pinned_blocks"] == 5
    hit = engine.generate(system + [4, 4, 4], GREEDY).run()
    assert hit.timings.cached_tokens == 20
    cache.unpin(system)
    assert cache.stats()["pinned_blocks"] == 0
    with pytest.raises(InvalidParameterError, match="no pin"):
        cache.unpin(system)
    with pytest.raises(InvalidParameterError, match="less than one cache block"):
        cache.pin([1, 2])
    with pytest.raises(InvalidParameterError, match=r"pin\(\) token_ids is str, not token ids"):
        cache.pin("the system prompt")
    with pytest.raises(InvalidParameterError, match=r"pin\(\) token_ids must hold integer token ids; got 1.5"):
        cache.pin([1.5] * 8)  # it was rounded down to token 1
    with pytest.raises(InvalidParameterError, match=r"unpin\(\) token_ids is str"):
        cache.unpin("the system prompt")
    with pytest.raises(InvalidParameterError, match=r"token ids must be in \[0, 256\); got \[999\]"):
        cache.pin([5] * 7 + [999])  # computing its KV would index past the embedding table
    cache.check_integrity()


def test_changes_count_what_a_cache_file_would_hold(model):
    engine, cache = cached_engine(model)
    seen = [cache.changes]

    def moved(expected):
        seen.append(cache.changes)
        assert (seen[-1] > seen[-2]) is expected

    cache.stats(), cache.tree(), cache.export_blocks()
    moved(False)  # looking changes nothing
    engine.generate(rand_ids(40, 1), GREEDY).run()
    moved(True)  # new blocks
    engine.generate(rand_ids(40, 1), GREEDY).run()
    moved(True)  # a hit: its blocks move to the back of the eviction order
    cache.pin(rand_ids(40, 1))
    moved(True)
    cache.unpin(rand_ids(40, 1))
    moved(True)
    cache.reset()
    moved(True)
    cache.stats()
    moved(False)


def test_one_memory_budget_split_once_between_running_requests_and_the_prefix_cache(model, monkeypatch):
    import kvtool.cache.store as store
    from kvtool.engine.engine import kv_budget_tokens

    reads = []
    monkeypatch.setattr(store, "available_memory", lambda device="cpu": reads.append(device) or 8 << 30)
    engine = Engine(model, EngineConfig())  # half of 8 GiB is the budget: 2 GiB each
    assert engine.memory == (2 << 30, 2 << 30) and len(reads) == 1
    assert kv_budget_tokens(engine) == (2 << 30) // model.runner.spec.kv_bytes_per_token(4)  # fp32
    assert attach_prefix_cache(engine).budget_bytes == 2 << 30 and len(reads) == 1  # the split, not a new read
    assert Engine(model, EngineConfig(kv_bytes=1 << 20)).memory == (1 << 20, 2 << 30)
    assert Engine(model, EngineConfig(kv_bytes=1 << 20, cache_bytes=0)).memory == (1 << 20, 0) and len(reads) == 2
    assert PrefixCache.for_runner(model.runner).budget_bytes == 2 << 30  # without an engine: the same half
    monkeypatch.setattr(store, "available_memory", lambda device="cpu": 1 << 40)
    assert Engine(model, EngineConfig()).memory == (16 << 30, 16 << 30)  # the budget stops at 32 GiB


def test_budget_defaults_and_bad_values(model):
    assert 0 < sum(memory_split(None, None, "cpu")) <= 32 << 30
    with pytest.raises(InvalidParameterError, match="budget"):
        PrefixCache.for_runner(model.runner, budget_bytes=-1)
    with pytest.raises(InvalidParameterError, match="block_size must be an integer >= 1 tokens, got 0"):
        PrefixCache.for_runner(model.runner, budget_bytes=1 << 20, block_size=0)
    engine = Engine(model, EngineConfig(enable_prefix_cache=False))
    assert attach_prefix_cache(engine) is None and engine.prefix_cache is None
    engine = Engine(model, EngineConfig(cache_bytes=123_456, prefix_block=8))
    cache = attach_prefix_cache(engine)
    assert cache.budget_bytes == 123_456 and cache.block_size == 8 and engine.prefix_cache is cache
    lines = cache.prometheus_lines()
    assert "kvtool_prefix_cache_hit_rate 0.0" in lines and "# TYPE kvtool_prefix_cache_evictions_total counter" in lines


def test_http_router_on_a_bare_app(model):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from kvtool.serving.cache_http import cache_router

    engine, cache = cached_engine(model)
    holder = {"cache": cache}
    app = FastAPI()
    app.include_router(cache_router(lambda: holder["cache"]))
    client = TestClient(app)
    ids = rand_ids(10, 11)
    r = client.post("/v1/cache/pin", json={"token_ids": ids})
    assert r.status_code == 200 and r.json()["pinned_tokens"] == 8 and r.json()["cache"]["pinned_blocks"] == 2
    s = client.get("/v1/cache").json()
    assert s["object"] == "prefix_cache" and s["blocks"] == 2 and "hit_rate" in s
    assert client.post("/v1/cache/unpin", json={"token_ids": ids}).json()["cache"]["pinned_blocks"] == 0
    r = client.post("/v1/cache/reset")
    assert r.status_code == 200 and r.json()["freed_blocks"] == 2 and r.json()["cache"]["blocks"] == 0
    for body, param in [({"token_ids": [1, "x"]}, "token_ids"), ({"token_ids": [1], "prompt": "a"}, "token_ids"),
                        ({"messages": [{"role": "user", "content": "hi"}]}, "messages"),
                        ({"token_ids": [999999]}, "token_ids"), ({"tokens": [1]}, None)]:
        r = client.post("/v1/cache/pin", json=body)
        err = r.json()["error"]
        assert r.status_code == 400 and err["type"] == "invalid_request_error" and err["param"] == param, body
        assert set(err) == {"message", "type", "param", "code"}
    r = client.post("/v1/cache/pin", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = client.post("/v1/cache/unpin", json={"token_ids": ids})
    assert r.status_code == 400 and "no pin" in r.json()["error"]["message"]
    r = client.post("/v1/cache/save")
    assert r.status_code == 404 and r.json()["error"]["code"] == "no_cache_file"
    tree = client.get("/v1/cache/tree?token_ids=true").json()  # no model: ids, no text
    assert tree["segments"] == 0 and tree["tree"] == []
    holder["cache"] = None
    r = client.get("/v1/cache")
    assert r.status_code == 404 and r.json()["error"]["code"] == "prefix_cache_disabled"
    assert client.get("/v1/cache/tree").status_code == 404 and client.post("/v1/cache/save").status_code == 404


def test_http_save_to_a_path_that_cannot_be_written_is_a_500_that_says_why(model, tmp_path):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from kvtool.serving.cache_http import cache_router

    engine, cache = cached_engine(model)
    out = engine.generate(rand_ids(12, 5), GREEDY).run().token_ids
    (tmp_path / "a-file").write_text("x")
    app = FastAPI()
    app.include_router(cache_router(lambda: cache, cache_file=str(tmp_path / "a-file" / "c.kvc")))
    r = TestClient(app).post("/v1/cache/save")
    assert r.status_code == 500 and r.json()["error"]["code"] == "cache_file_unwritable"
    assert "could not write the cache file" in r.json()["error"]["message"]
    tree = TestClient(app).get("/v1/cache/tree?token_ids=true").json()["tree"]
    assert tree[0]["token_ids"] == (rand_ids(12, 5) + out)[:20]  # 12 + 12 tokens, 23 with KV: 5 blocks of 4


# ---- long random workload: a real BlockStore with tiny tensors, a fake model whose KV at position p
# is a deterministic function of tokens[:p+1], so any reused block can be checked for correctness.

L, H, D = 2, 1, 2


def fake_kv(tokens, start, end):
    vals = [float(hash(tuple(tokens[: p + 1])) % 1_000_003) for p in range(start, end)]
    t = torch.tensor(vals).view(1, 1, -1, 1).expand(L, H, -1, D)
    return t, -t


class FakeRunner:
    def new_cache(self, capacity=16):
        return KVCache.empty(L, H, D, torch.float32, "cpu", capacity)


def run_workload(ops, budget_blocks, seed):
    runner = FakeRunner()
    cache = PrefixCache(L, H, D, budget_bytes=0, block_size=BS)
    budget = budget_blocks * cache.store.bytes_per_block
    cache.set_budget(budget)
    rng = random.Random(seed)
    stems = [[rng.randrange(1, 50) for _ in range(rng.randrange(0, 24))] for _ in range(6)]
    running = []  # (handle, tokens, cache) of requests prepared but not committed
    for op in ops:
        if op == "start" or not running:
            tokens = rng.choice(stems)[: rng.randrange(0, 25)] + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 12))]
            kv, n, handle = cache.prepare(tokens, runner)
            expect_k, _ = fake_kv(tokens, 0, n)
            assert torch.equal(torch.stack([layer.keys[0] for layer in kv.layers]), expect_k), "reused wrong KV"
            k, v = fake_kv(tokens, n, len(tokens))
            kv.append_all(k, v)
            running.append((handle, tokens, kv))
        elif op == "finish":
            handle, tokens, kv = running.pop(rng.randrange(len(running)))
            cut = rng.randrange(len(tokens) // 2, len(tokens) + 1)  # aborted requests commit less
            kv.truncate(cut)
            cache.commit(handle, tokens[:cut], kv)
        elif op == "publish":  # a running request shares what it has computed so far, keeping its hold
            handle, tokens, kv = rng.choice(running)
            cache.publish(handle, tokens[: kv.offset], kv)
        elif op == "reset":
            cache.reset()
        elif op == "pin":
            stem = rng.choice(stems)
            if len(stem) >= BS and cache.index.match(stem, record=False):
                cache.pin(stem[: len(cache.index.match(stem, record=False)) * BS])
        elif op == "unpin" and cache.index._pin_records:
            key = rng.choice(list(cache.index._pin_records))
            cache.unpin(list(key))
        cache.check_integrity()
        assert cache.stats()["bytes_in_use"] <= budget
    for handle, tokens, kv in running:
        cache.commit(handle, tokens, kv)
    cache.check_integrity()
    return cache


@pytest.mark.filterwarnings("ignore::kvtool.errors.PrefixCacheWarning")
def test_thousands_of_random_requests_stay_under_budget():
    ops = random.Random(0).choices(["start", "finish", "publish", "reset", "pin", "unpin"],
                                   weights=[45, 45, 10, 1, 2, 2], k=4000)
    cache = run_workload(ops, budget_blocks=10, seed=0)
    s = cache.stats()
    assert s["queries"] > 1500 and s["hit_tokens"] > 0 and s["evictions"] > 100


@pytest.mark.filterwarnings("ignore::kvtool.errors.PrefixCacheWarning")
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.sampled_from(["start", "start", "finish", "finish", "publish", "reset", "pin", "unpin"]),
                    min_size=1, max_size=80),
       budget_blocks=st.integers(0, 8), seed=st.integers(0, 10_000))
def test_random_workloads_keep_integrity(ops, budget_blocks, seed):
    run_workload(ops, budget_blocks, seed)


def test_the_package_names_the_cache_classes():
    import kvtool.cache
    from kvtool.cache import PrefixCache, attach_prefix_cache, manager

    assert PrefixCache is manager.PrefixCache and attach_prefix_cache is manager.attach_prefix_cache
    with pytest.raises(AttributeError, match="no attribute 'Prefix_Cache'"):
        kvtool.cache.Prefix_Cache
