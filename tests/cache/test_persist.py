"""Saving a PrefixCache and loading it into another (kvtool.cache.persist) on a tiny random model: the
KV, pins and recency come back, another block size or a smaller budget still loads, and a damaged file
or one made for another model is refused by name."""

from __future__ import annotations

import random
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtool import SamplingParams
from kvtool.cache.kvfile import setup_of
from kvtool.cache.manager import PrefixCache
from kvtool.config import EngineConfig
from kvtool.engine import Engine
from kvtool.errors import CacheFormatError, InvalidParameterError, PrefixCacheWarning
from kvtool.testing.tiny import tiny_checkpoint, tiny_runner
from tests.cache.test_manager import BS, TinyModel, cached_engine, rand_ids

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-qwen3-persist")
    tiny_checkpoint("qwen3", folder)
    return TinyModel(tiny_runner("qwen3", folder))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama-persist")
    tiny_checkpoint("llama", folder)
    return TinyModel(tiny_runner("llama", folder))


def fresh(model, budget=1 << 22, block_size=BS):
    return PrefixCache.for_runner(model.runner, budget_bytes=budget, block_size=block_size)


def chain_kv(cache, tokens):
    """The cached KV of tokens' longest cached prefix, [2, L, H, T, D]."""
    ids, store = cache.index.match(tokens, record=False), cache.store
    return torch.cat([*store.tensors(ids), torch.empty(*store.block_shape[:3], 0, store.head_dim)], dim=3)


@pytest.fixture(scope="module")
def saved(model, tmp_path_factory):
    """A cache after a few conversations sharing a 40-token prefix, a pin, and its file."""
    engine, cache = cached_engine(model)
    base = rand_ids(40, 1)
    prompts = [base + rand_ids(10, 10 + i) for i in range(3)] + [rand_ids(23, 99)]
    outputs = [engine.generate(p, GREEDY).run().token_ids for p in prompts]
    cache.pin(base[:20])
    path = tmp_path_factory.mktemp("kvc") / "cache.kvc"
    info = cache.save(path)
    return cache, path, info, prompts, outputs, base


def test_round_trip_keeps_kv_pins_and_greedy_output(model, saved):
    cache, path, info, prompts, outputs, base = saved
    assert info["blocks"] == cache.stats()["blocks"] > 0 and info["pins"] == 1
    assert sum(p.stat().st_size for p in path.parent.iterdir()) == info["bytes"]  # the manifest and its data
    engine = Engine(model, EngineConfig(prefill_chunk=16))
    loaded = fresh(model)
    engine.prefix_cache = loaded
    result = loaded.load(path)
    loaded.check_integrity()
    assert result["loaded_tokens"] == result["tokens"] == info["tokens"] and result["pins"] == 1
    assert loaded.loaded == result
    assert {k: loaded.stats()[k] for k in ("blocks", "pinned_blocks", "bytes_in_use")} == \
        {k: cache.stats()[k] for k in ("blocks", "pinned_blocks", "bytes_in_use")}
    for prompt in prompts:
        assert torch.equal(chain_kv(loaded, prompt), chain_kv(cache, prompt))
    for prompt, tokens in zip(prompts, outputs):
        gen = engine.generate(prompt, GREEDY).run()
        assert gen.token_ids == tokens
        assert gen.timings.cached_tokens == len(prompt) - 1  # all but the last token: full blocks, then a slice
    # the pin came back as a pin: it holds its blocks through a reset-free flood, and unpin() finds it
    loaded.set_budget(loaded.store.bytes_per_block * 5)
    loaded.check_integrity()
    assert loaded.cached_tokens(base[:20]) == 20
    assert loaded.unpin(base[:20])["unpinned_tokens"] == 20
    with pytest.raises(InvalidParameterError, match="no pin"):
        loaded.unpin(base[:20])


def test_most_recent_prefixes_survive_a_smaller_budget(model, saved):
    cache, path, _, prompts, _, base = saved
    # 26 blocks saved: 10 of the shared base, 3 of each conversation's own, 7 of the last prompt; room for 20
    assert cache.stats()["blocks"] == 26
    small = fresh(model, budget=cache.store.bytes_per_block * 20)
    with pytest.warns(PrefixCacheWarning, match=r"holds 80 of the 104 tokens.*raise --cache-bytes"):
        result = small.load(path)
    small.check_integrity()
    assert small.store.nbytes == small.budget_bytes and result["loaded_tokens"] == 80
    assert small.cached_tokens(base[:20]) == 20  # pinned: loaded first and kept
    # loaded from the least to the most recently used: the two oldest conversations lost their own blocks
    assert [small.cached_tokens(p) for p in prompts] == [40, 40, 48, 20]


def test_another_block_size_recuts_the_chains(model, saved):
    cache, path, _, prompts, outputs, _ = saved
    engine = Engine(model, EngineConfig(prefill_chunk=16))
    engine.prefix_cache = wide = fresh(model, block_size=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a chain's tail short of a block is not a budget shortfall
        wide.load(path)
    wide.check_integrity()
    for prompt, tokens in zip(prompts, outputs):
        assert wide.cached_tokens(prompt) == len(prompt) // 8 * 8
        assert engine.generate(prompt, GREEDY).run().token_ids == tokens


def test_an_empty_cache_saves_and_loads(model, tmp_path):
    info = fresh(model).save(tmp_path / "empty.kvc")
    assert info["blocks"] == 0
    cache = fresh(model)
    assert cache.load(tmp_path / "empty.kvc")["loaded_tokens"] == 0
    cache.check_integrity()
    assert cache.stats()["blocks"] == 0


def test_a_cache_from_another_model_is_refused_by_name(llama, saved):
    with pytest.raises(CacheFormatError, match="saved for a different setup: model config: file has") as err:
        fresh(llama).load(saved[1])
    assert "RoPE setting" in str(err.value) and "delete the file or give another path" in str(err.value)


def test_damaged_truncated_and_foreign_files_are_refused(model, saved, tmp_path):
    path = saved[1]
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # a KV byte (tensor data comes after the header)
    (tmp_path / "flipped.kvc").write_bytes(bytes(data))
    with pytest.raises(CacheFormatError, match="checksum mismatch"):
        fresh(model).load(tmp_path / "flipped.kvc")
    (tmp_path / "cut.kvc").write_bytes(path.read_bytes()[: len(data) // 2])
    with pytest.raises(CacheFormatError, match="not a readable prefix cache .truncated"):
        fresh(model).load(tmp_path / "cut.kvc")
    with pytest.raises(CacheFormatError, match="no such prefix cache file"):
        fresh(model).load(tmp_path / "missing.kvc")
    with pytest.raises(CacheFormatError, match=r"is a folder, not a prefix cache \(.kvc\) file"):
        fresh(model).load(tmp_path)

    from kvtool.skills import compile_ids, save_block, setup_of

    block = compile_ids(model.runner, rand_ids(8, 3), setup_of(runner=model.runner), "b")
    save_block(block, tmp_path / "block.kvb")
    with pytest.raises(CacheFormatError, match="not a kvtool prefix cache .format 'kvtool.skill-block'"):
        fresh(model).load(tmp_path / "block.kvb")


def test_a_failed_save_keeps_the_old_file(model, saved, tmp_path, monkeypatch):
    import safetensors.torch

    cache = saved[0]
    target = tmp_path / "keep.kvc"
    save_v1(cache, target, setup_of(runner=model.runner))  # a version-1 file: this save writes all anew
    path = tmp_path.parent / "keep-copy.kvc"
    path.write_bytes(target.read_bytes())

    def disk_full(tensors, filename, metadata=None):
        with open(filename, "wb") as fh:
            fh.write(b"\0" * 100)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", disk_full)
    with pytest.raises(OSError, match="No space left"):
        cache.save(target)
    assert target.read_bytes() == path.read_bytes() and [p.name for p in tmp_path.iterdir()] == ["keep.kvc"]
    monkeypatch.undo()
    assert fresh(model).load(target)["loaded_tokens"] == saved[2]["tokens"]


def test_concurrent_saves_of_one_path_each_leave_a_whole_file(model, saved, tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    cache, target = saved[0], tmp_path / "shared.kvc"
    with ThreadPoolExecutor(4) as pool:  # e.g. POST /v1/cache/save while the server shuts down
        list(pool.map(lambda _: cache.save(target), range(8)))
    names = sorted(p.name for p in tmp_path.iterdir())
    assert len(names) == 2 and names[0] == "shared.kvc" and names[1].startswith("shared.kvc.")
    assert all(p.stat().st_mode & 0o077 == 0 for p in tmp_path.iterdir())
    assert fresh(model).load(target)["loaded_tokens"] == saved[2]["tokens"]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10**6), blocks=st.integers(4, 40))
def test_random_trees_round_trip_under_any_budget(model, tmp_path_factory, seed, blocks):
    """Random prefix trees and pins, saved and loaded into a random budget and block size: integrity holds,
    the budget is kept, and every loaded prefix has exactly the saved KV."""
    rng = random.Random(seed)
    source = fresh(model)
    runner = model.runner
    roots = [rand_ids(rng.randint(4, 16), rng.random()) for _ in range(3)]
    prompts = []
    for _ in range(6):
        tokens = rng.choice(roots) + rand_ids(rng.randint(0, 20), rng.random())
        cache = runner.new_cache(len(tokens) + 1)
        runner.prefill(tokens, cache, logits="none")
        source._insert(tokens, cache, what="test")
        prompts.append(tokens)
        if rng.random() < 0.3 and len(tokens) >= BS:
            source.pin(tokens[: rng.randint(BS, len(tokens))])
    path = tmp_path_factory.mktemp("rand") / "c.kvc"
    source.save(path)
    target = fresh(model, budget=source.store.bytes_per_block * blocks, block_size=rng.choice([BS, 2 * BS]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PrefixCacheWarning)
        target.load(path)
    target.check_integrity()
    assert target.store.nbytes <= target.budget_bytes
    for tokens in prompts:
        n = target.cached_tokens(tokens)
        assert torch.equal(chain_kv(target, tokens), chain_kv(source, tokens)[:, :, :, :n])


def test_a_verified_file_whose_tensors_do_not_match_its_blocks_is_refused(model, saved, tmp_path):
    from kvtool.cache.kvfile import CheckedFile, write_checked
    from kvtool.cache.persist import FORMAT, FORMAT_VERSION, block_name

    save_v1(saved[0], tmp_path / "v1.kvc", setup_of(runner=model.runner))
    with CheckedFile(tmp_path / "v1.kvc", "prefix cache (.kvc)", FORMAT, FORMAT_VERSION, "Delete it.") as f:
        meta, tensors = dict(f.meta), {name: f.tensor(name) for name in f.names}
    missing = dict(tensors)
    del missing[block_name(3)]
    write_checked(tmp_path / "missing.kvc", missing, meta)  # a valid checksum over the wrong contents
    with pytest.raises(CacheFormatError, match="checksum mismatch.*its KV tensors are not one per block"):
        fresh(model).load(tmp_path / "missing.kvc")
    halved = {**tensors, block_name(0): tensors[block_name(0)].half()}
    write_checked(tmp_path / "half.kvc", halved, meta)
    with pytest.raises(CacheFormatError, match=r"block 0 is torch.float16 .*this cache holds torch.float32"):
        fresh(model).load(tmp_path / "half.kvc")


def save_v1(cache, path, setup) -> None:
    """Write a version-1 file (the KV inside the .kvc itself), as older kvtools did: loading still reads them."""
    from kvtool.cache.kvfile import write_checked
    from kvtool.cache.persist import block_name, snapshot

    index, kv, meta = snapshot(cache, setup)
    write_checked(path, {**{block_name(j): t for j, t in enumerate(kv)}, **index["tensors"]}, meta)
