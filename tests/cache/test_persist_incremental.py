"""Incremental prefix-cache files (format version 2, kvtool.cache.kvlog) on a tiny random model: a save writes
only new blocks, a save after hits writes nothing, a torn tail is dropped with a warning, evicted blocks
are compacted away, a restarted process continues the same data file, and version-1 files still load."""

from __future__ import annotations

import warnings

import pytest
import torch

from kvtool.cache.kvfile import setup_of
from kvtool.cache.persist import describe_file
from kvtool.errors import CacheFormatError, PrefixCacheWarning
from tests.cache.test_manager import BS, cached_engine, rand_ids
from tests.cache.test_persist import GREEDY, chain_kv, fresh, model, save_v1  # noqa: F401 (model: a fixture)


def data_files(path):
    return sorted(p for p in path.parent.iterdir() if p.name.startswith(path.name + ".") and p.suffix == ".data")


def test_a_save_writes_only_new_blocks_and_nothing_after_hits(model, tmp_path):
    engine, cache = cached_engine(model)
    path = tmp_path / "c.kvc"
    engine.generate(rand_ids(4 * BS + 3, 1), GREEDY).run()
    first = cache.save(path)
    block = cache.store.bytes_per_block
    assert first["blocks"] == cache.stats()["blocks"] > 0
    assert first["written_bytes"] - path.stat().st_size == first["blocks"] * block  # all of it, once
    engine.generate(rand_ids(4 * BS + 3, 1), GREEDY).run()  # a pure hit on every block it has
    hits = cache.save(path)
    assert hits["unchanged"] and hits["written_bytes"] == 0
    engine.generate(rand_ids(2 * BS + 1, 7), GREEDY).run()
    grown = cache.stats()["blocks"] - first["blocks"]
    second = cache.save(path)
    assert grown > 0 and second["written_bytes"] - path.stat().st_size == grown * block
    assert len(data_files(path)) == 1 and second["bytes"] == path.stat().st_size + data_files(path)[0].stat().st_size
    loaded = fresh(model)
    assert loaded.load(path)["loaded_tokens"] == second["tokens"]
    loaded.check_integrity()
    assert describe_file(path)["format_version"] == "2" and describe_file(path)["bytes"] == second["bytes"]


def test_a_torn_tail_is_dropped_with_a_warning_and_cut_at_the_next_save(model, tmp_path):
    engine, cache = cached_engine(model)
    path = tmp_path / "c.kvc"
    engine.generate(rand_ids(3 * BS, 2), GREEDY).run()
    info = cache.save(path)
    data = data_files(path)[0]
    size = data.stat().st_size
    with open(data, "ab") as fh:  # a save killed mid-append: half a block past what the manifest names
        fh.write(b"\x5a" * (cache.store.bytes_per_block // 2))
    with pytest.warns(PrefixCacheWarning, match=r"written after the last completed save .* ignored"):
        assert fresh(model).load(path)["loaded_tokens"] == info["tokens"]
    restarted = fresh(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PrefixCacheWarning)
        restarted.load(path)
    restarted_engine, _ = cached_engine(model)
    restarted_engine.prefix_cache = restarted
    restarted_engine.generate(rand_ids(2 * BS, 3), GREEDY).run()
    after = restarted.save(path)  # the restarted process continues the same data file from the manifest's end
    added = (after["blocks"] - info["blocks"]) * cache.store.bytes_per_block
    assert data_files(path) == [data] and added > 0
    assert data.stat().st_size == size + added  # the torn tail was cut off, then only the new blocks appended
    assert after["written_bytes"] - path.stat().st_size == added
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fresh(model).load(path)["loaded_tokens"] == after["tokens"]


def test_a_damaged_or_missing_data_file_is_refused(model, tmp_path):
    engine, cache = cached_engine(model)
    path = tmp_path / "c.kvc"
    engine.generate(rand_ids(3 * BS, 4), GREEDY).run()
    cache.save(path)
    data = data_files(path)[0]
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(CacheFormatError, match=r"checksum mismatch.*block \d+ in .* does not match its sha256"):
        fresh(model).load(path)
    data.write_bytes(bytes(raw[: len(raw) // 2]))
    with pytest.raises(CacheFormatError, match="it was cut"):
        fresh(model).load(path)
    data.unlink()
    with pytest.raises(CacheFormatError, match="data file .* is missing"):
        fresh(model).load(path)


def test_evicted_blocks_are_compacted_away(model, tmp_path):
    engine, cache = cached_engine(model)
    path = tmp_path / "c.kvc"
    engine.generate(rand_ids(6 * BS, 5), GREEDY).run()
    cache.save(path)
    old = data_files(path)[0]
    cache.reset()  # every saved block is dead now
    engine.generate(rand_ids(2 * BS, 6), GREEDY).run()
    info = cache.save(path)
    assert info["compacted"] and not old.exists() and len(data_files(path)) == 1
    assert data_files(path)[0].stat().st_size == info["blocks"] * cache.store.bytes_per_block
    loaded = fresh(model)
    assert loaded.load(path)["loaded_tokens"] == info["tokens"]
    prompt = rand_ids(2 * BS, 6)
    assert torch.equal(chain_kv(loaded, prompt), chain_kv(cache, prompt))


def test_a_version_1_file_still_loads_and_is_replaced_by_version_2(model, tmp_path):
    engine, cache = cached_engine(model)
    path = tmp_path / "c.kvc"
    prompt = rand_ids(3 * BS + 2, 8)
    engine.generate(prompt, GREEDY).run()
    save_v1(cache, path, setup_of(runner=model.runner))
    assert describe_file(path)["format_version"] == "1" and not data_files(path)
    loaded = fresh(model)
    tokens = cache.stats()["blocks"] * BS
    assert loaded.load(path)["loaded_tokens"] == tokens > 0
    assert torch.equal(chain_kv(loaded, prompt), chain_kv(cache, prompt))
    loaded.save(path)
    assert describe_file(path)["format_version"] == "2" and len(data_files(path)) == 1
    assert fresh(model).load(path)["loaded_tokens"] == tokens
