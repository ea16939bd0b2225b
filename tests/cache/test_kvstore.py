"""The shared block store without a model: records (kvtool.cache.blockrecord), the folder backend
(kvtool.cache.dirstore) alone and with several writer processes at once, and SharedBlocks over it (a bad record is
a miss, removed). The Redis backend runs the same checks in test_redisstore.py."""

from __future__ import annotations

import json
import multiprocessing
import os
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtool.cache.blockrecord import Layout, decode, encode
from kvtool.cache.dirstore import LOW, DirStore
from kvtool.cache.kvstore import open_store
from kvtool.cache.manager import PrefixCache
from kvtool.cache.shared import SharedBlocks, describe_store
from kvtool.errors import InvalidParameterError

SETUP = {"model": "store-test", "config_hash": "0", "tokenizer_hash": "0", "dtype": "float32", "rope": "{}"}
LAYOUT = Layout(SETUP, 2, 2, 4, "float32", 4)


def record_for(layout: Layout, tokens: list[int], i: int, size: int = 0) -> tuple[str, bytes]:
    """(key, record) of block i of tokens, its payload a function of the key (every writer writes the same)."""
    keys = layout.keys(tokens)
    payload = (keys[i].encode() * (size // 32 + 1))[: max(size, 32)]
    bs = layout.block_size
    return keys[i], encode(layout, keys[i], keys[i - 1] if i else None, tokens[i * bs : (i + 1) * bs], payload)


# ---- records ------------------------------------------------------------------------------------------------------


@given(st.lists(st.integers(0, 2**40), min_size=4, max_size=40), st.data())
@settings(max_examples=60, deadline=None)
def test_a_record_reads_back_whole_and_any_cut_or_flipped_byte_reads_as_a_miss(tokens, data):
    key, record = record_for(LAYOUT, tokens, len(tokens) // 4 - 1, size=data.draw(st.integers(0, 300)))
    header, payload = decode(record, key)
    assert header["key"] == key and header["tokens"] == tokens[len(tokens) // 4 * 4 - 4 : len(tokens) // 4 * 4]
    assert bytes(payload)[:32] == key.encode()
    assert decode(record, "0" * 32) is None  # another key's name
    cut = data.draw(st.integers(0, len(record) - 1))
    assert decode(record[:cut], key) is None  # torn
    flip = data.draw(st.integers(0, len(record) - 1))
    damaged = bytearray(record)
    damaged[flip] ^= 1 << data.draw(st.integers(0, 7))
    assert decode(bytes(damaged), key) is None


@given(st.lists(st.integers(0, 50_000), min_size=8, max_size=64))
def test_keys_are_a_chain_rooted_in_the_layout(tokens):
    keys = LAYOUT.keys(tokens)
    assert len(keys) == len(tokens) // 4 and len(set(keys)) == len(keys)
    assert LAYOUT.keys(tokens[:8]) == keys[:2]  # a prefix's keys are the chain's first keys
    assert LAYOUT.keys(tokens, 1) == keys[:1]
    others = [Layout({**SETUP, "model": "other"}, 2, 2, 4, "float32", 4), Layout(SETUP, 2, 2, 4, "bfloat16", 4),
              Layout(SETUP, 2, 2, 4, "float32", 4, heads=(0, 1)), Layout(SETUP, 3, 2, 4, "float32", 4)]
    for other in others:  # another model, dtype, TP rank's heads, layer count: other keys for the same tokens
        assert not set(other.keys(tokens)) & set(keys)
    changed = [tokens[0] + 1] + tokens[1:]
    assert not set(LAYOUT.keys(changed)) & set(keys)  # one token earlier changes every later key
    assert Layout(SETUP, 2, 2, 4, "float32", 4, heads=(0, 2)).keys(tokens) == keys  # all heads, said either way


# ---- the folder store ---------------------------------------------------------------------------------------------


def test_folder_store_publishes_once_and_keeps_its_limit_for_every_process(tmp_path):
    store = DirStore(str(tmp_path / "s"), limit_bytes=10_000)
    key, record = record_for(LAYOUT, list(range(8)), 1, size=100)
    assert store.put(key, record) and not store.put(key, record)  # a second writer of a key writes nothing
    assert store.get(key) == record and store.get("ab" * 16) is None
    assert list(store.keys()) == [key]
    assert DirStore(str(tmp_path / "s")).limit_bytes == 10_000  # the folder keeps it for the next process
    DirStore(str(tmp_path / "s"), limit_bytes=20_000)
    assert store.limit_bytes == 20_000  # the latest setting holds for every process, read anew
    assert store.usage()["blocks"] == 1 and store.usage()["bytes"] == len(record)
    store.check_integrity()
    (tmp_path / "f").write_text("x")
    with pytest.raises(InvalidParameterError, match="is a file"):
        open_store(str(tmp_path / "f"))
    with pytest.raises(InvalidParameterError, match="no backend for ftp://"):
        open_store("ftp://x/y")
    with pytest.raises(InvalidParameterError, match="integer >= 1"):
        DirStore(str(tmp_path / "s"), limit_bytes=0)


def test_eviction_takes_the_least_recently_used_chain_leaves_first_and_stale_temp_files(tmp_path):
    store = DirStore(str(tmp_path), limit_bytes=10**9)
    chains = [[1000 + c * 100 + t for t in range(16)] for c in range(4)]  # 4 chains of 4 blocks, one size
    for tokens in chains:
        keys = [store.put(*record_for(LAYOUT, tokens, i, size=1000)) for i in range(4)]
        assert all(keys)
        store.touch(LAYOUT.keys(tokens))
        time.sleep(0.01)
    store.touch(LAYOUT.keys(chains[0]))  # chain 0 read again: now the most recent
    stale = tmp_path / "blocks" / "00" / ".dead.tmp"
    stale.parent.mkdir(exist_ok=True)
    stale.write_bytes(b"x" * 500)  # a killed writer's
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    sizes = [[len(record_for(LAYOUT, c, i, size=1000)[1]) for i in range(4)] for c in chains]
    kept = sum(sizes[0]) + sum(sizes[2]) + sum(sizes[3])
    DirStore(str(tmp_path), limit_bytes=int(kept / LOW) + 1)  # room for 12 of the 16 blocks, after LOW
    assert store.evict() == sum(sizes[1]) + 500 and not stale.exists()
    held = set(store.keys())
    assert len(held) == 12
    assert not set(LAYOUT.keys(chains[1])) & held  # the least recently used chain went, whole
    assert all(set(LAYOUT.keys(c)) <= held for c in (chains[0], chains[2], chains[3]))
    kept -= sizes[2][2] + sizes[2][3]
    DirStore(str(tmp_path), limit_bytes=int(kept / LOW) + 1)  # two blocks fewer
    assert store.evict() == sizes[2][2] + sizes[2][3]
    assert set(store.keys()) == held - set(LAYOUT.keys(chains[2])[2:])  # the next chain loses its leaves first
    store.check_integrity()


def writer(root: str, chains: list[list[int]], limit: int, seed: int) -> None:
    """A process writing every block of its chains (parents first), reading some back, as an engine would."""
    store = DirStore(root)
    for n, tokens in enumerate(chains):
        for i in range(len(tokens) // LAYOUT.block_size):
            key, record = record_for(LAYOUT, tokens, i, size=2000)
            store.put(key, record)
            got = store.get(key)
            assert got is None or got == record, "a reader saw another block's bytes"
        store.touch(LAYOUT.keys(tokens))
        if (n + seed) % 3 == 0:
            store.evict()


@given(st.lists(st.lists(st.lists(st.integers(0, 3), min_size=8, max_size=24), min_size=1, max_size=6),
                min_size=2, max_size=4),
       st.integers(4, 40))
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_several_writer_processes_at_once_leave_whole_blocks_within_the_limit(tmp_path_factory, work, limit_blocks):
    root = str(tmp_path_factory.mktemp("store"))
    size = len(record_for(LAYOUT, [0] * 4, 0, size=2000)[1])
    limit = limit_blocks * size
    DirStore(root, limit_bytes=limit)
    ctx = multiprocessing.get_context("fork")  # (the writers are pure Python: no torch threads in the children)
    procs = [ctx.Process(target=writer, args=(root, chains, limit, seed)) for seed, chains in enumerate(work)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    store = DirStore(root)
    store.check_integrity()  # every published block whole under its own key
    usage = store.usage()
    assert usage["temp_bytes"] == 0  # writers that finished leave no temp file
    assert usage["bytes"] <= limit + len(work) * (limit // 16 + size)  # the documented bound
    written = {record_for(LAYOUT, c, i, size=2000)[0]: record_for(LAYOUT, c, i, size=2000)[1]
               for chains in work for c in chains for i in range(len(c) // 4)}
    for key in store.keys():
        assert store.get(key) == written[key]


# ---- SharedBlocks over a folder -----------------------------------------------------------------------------------


def cache_on(root, budget_blocks: int = 64) -> PrefixCache:
    cache = PrefixCache(2, 2, 4, budget_bytes=budget_blocks * 2 * 2 * 2 * 4 * 4 * 4, block_size=4)
    cache.shared = SharedBlocks.for_cache(str(root), None, SETUP, cache.store)
    return cache


def kv_of(i):
    return torch.full((2, 2, 4, 4), float(i)), torch.full((2, 2, 4, 4), -float(i) - 0.5)


def test_a_second_cache_adopts_what_the_first_stored_and_a_damaged_block_is_a_miss(tmp_path):
    first, tokens = cache_on(tmp_path), list(range(100, 121))
    first.import_chain(tokens, kv_of)
    ids = first.index.match(tokens, record=False)
    first.shared.save(tokens, list(enumerate(ids)), first.store)
    first.shared.flush()
    assert first.shared.stats["store_written_blocks"] == 5
    keys = LAYOUT.keys(tokens)
    damaged = first.shared.store.path(keys[3])
    damaged.write_bytes(damaged.read_bytes()[:-7])  # as if torn by something that is not kvtool
    second = cache_on(tmp_path)
    cache, n, handle = second.prepare(tokens + [7], None)
    assert n == 12 and second.stats()["store_hit_tokens"] == 12 and second.stats()["store_bad_blocks"] == 1
    assert not damaged.exists()  # removed, so a writer puts it back whole
    k, v = second.store.gather(handle.block_ids)
    assert torch.equal(k[..., 8:12, :], kv_of(2)[0]) and torch.equal(v[..., :4, :], kv_of(0)[1])
    second.check_integrity()
    second.commit(handle, tokens + [7], cache)
    info = describe_store(first.shared.store)
    assert info["blocks"] == 4 and info["layouts"][0]["roots"] == 1 and info["layouts"][0]["orphans"] == 1
    assert info["layouts"][0]["model"] == "store-test" and info["damaged"] == 0


def test_a_store_that_fails_costs_a_miss_and_one_warning(tmp_path):
    from kvtool.errors import PrefixCacheWarning

    cache = cache_on(tmp_path)

    def broken(key):
        raise OSError("disk gone")

    cache.shared.store.get = broken
    with pytest.warns(PrefixCacheWarning, match="reading failed.*disk gone"):
        _, n, _ = cache.prepare(list(range(30)), None)
    assert n == 0 and cache.stats()["store_errors"] == 1


def test_cache_info_reads_a_store_and_serve_refuses_a_store_it_cannot_open(tmp_path, capsys):
    from kvtool.cli import main
    from tests.cache.test_redisstore import free_port

    cache = cache_on(tmp_path / "store")
    tokens = list(range(300, 317))
    cache.import_chain(tokens, kv_of)
    cache.shared.save(tokens, list(enumerate(cache.index.match(tokens, record=False))), cache.store)
    cache.shared.flush()
    assert main(["cache", "info", str(tmp_path / "store"), "--json"]) == 0
    described = json.loads(capsys.readouterr().out)
    assert (described["blocks"], described["layouts"][0]["tokens"], described["layouts"][0]["model"]) == \
        (4, 16, "store-test")
    assert main(["cache", "info", str(tmp_path / "store")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"{tmp_path / 'store'}: block store (folder), 4 blocks, ")
    assert "of 17179.9 MB" in lines[0]  # the default limit
    assert lines[1] == ("  store-test (float32, 2 layers x 2 KV heads x 4): 16 tokens in 4 blocks of 4, 0.0 MB, "
                        "1 chains, 0 blocks whose parent was evicted")
    (tmp_path / "plain").mkdir()
    assert main(["cache", "info", str(tmp_path / "plain")]) == 2
    assert "not a kvtool block store" in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    port = str(free_port())
    assert main(["serve", "--port", port, "--kv-store", str(tmp_path / "file")]) == 2
    assert "is a file; give a folder" in capsys.readouterr().err


def test_a_store_exports_to_a_kvc_file_that_imports_into_another_store(tmp_path, capsys):
    from kvtool.cache.persist import describe_file
    from kvtool.cli import main

    cache = cache_on(tmp_path / "a")
    chains = [list(range(400, 417)), list(range(400, 408)) + list(range(500, 510)), list(range(600, 612))]
    for tokens in chains:  # the first two share two blocks: 6 blocks; the third loses its root below
        cache.import_chain(tokens, kv_of)
        cache.shared.save(tokens, list(enumerate(cache.index.match(tokens, record=False))), cache.store)
        cache.shared.flush()
    cache.shared.store.discard(LAYOUT.keys(chains[2])[0])
    other = PrefixCache(2, 2, 4, budget_bytes=1 << 20, block_size=4)  # another model on the same store
    other.shared = SharedBlocks.for_cache(str(tmp_path / "a"), None, {**SETUP, "model": "other"}, other.store)
    other.import_chain(chains[0], kv_of)
    other.shared.save(chains[0], list(enumerate(other.index.match(chains[0], record=False))), other.store)
    other.shared.flush()
    assert main(["cache", "export", str(tmp_path / "a"), str(tmp_path / "x.kvc")]) == 2
    assert "holds blocks of 2 models or layouts (other (float32), store-test (float32)); name one" in \
        capsys.readouterr().err
    assert main(["cache", "export", str(tmp_path / "a"), str(tmp_path / "x.kvc"), "--model-name", "store-test"]) == 0
    assert capsys.readouterr().out.startswith("kvtool: exported 24 tokens in 6 blocks")
    described = describe_file(tmp_path / "x.kvc")
    assert described["blocks"] == 6 and described["setup"] == SETUP
    assert main(["cache", "import", str(tmp_path / "x.kvc"), str(tmp_path / "b")]) == 0
    assert "(6 blocks new there)" in capsys.readouterr().out
    assert describe_store(DirStore(str(tmp_path / "b")))["blocks"] == 6
    reader = cache_on(tmp_path / "b")
    got, n, handle = reader.prepare(chains[1] + [1], None)
    assert n == 16
    keys, values = reader.store.gather(handle.block_ids)
    for i in range(4):
        assert torch.equal(keys[..., 4 * i : 4 * i + 4, :], kv_of(i)[0])
        assert torch.equal(values[..., 4 * i : 4 * i + 4, :], kv_of(i)[1])
    reader.commit(handle, chains[1] + [1], got)
    assert main(["cache", "export", str(tmp_path / "none"), str(tmp_path / "y.kvc")]) == 2
    assert "not a kvtool block store" in capsys.readouterr().err


def test_a_commit_past_the_writers_queue_shares_its_chains_first_blocks(tmp_path, monkeypatch):
    import kvtool.cache.shared as shared

    monkeypatch.setattr(shared, "MAX_QUEUED_BLOCKS", 3)
    cache, tokens = cache_on(tmp_path), list(range(700, 721))
    cache.import_chain(tokens, kv_of)
    cache.shared.save(tokens, list(enumerate(cache.index.match(tokens, record=False)))[::-1], cache.store)
    cache.shared.flush()
    assert cache.shared.stats["store_dropped_blocks"] == 2 and cache.shared.stats["store_written_blocks"] == 3
    assert set(cache.shared.store.keys()) == set(LAYOUT.keys(tokens)[:3])  # a prefix of the chain: readable


@pytest.mark.parametrize("batch", [2, 64])
def test_a_long_chain_is_read_in_batches_as_far_as_the_cache_budget_holds(tmp_path, monkeypatch, batch):
    import kvtool.cache.shared as shared

    monkeypatch.setattr(shared, "READ_BATCH", batch)
    first, tokens = cache_on(tmp_path), list(range(800, 821))
    first.import_chain(tokens, kv_of)
    first.shared.save(tokens, list(enumerate(first.index.match(tokens, record=False))), first.store)
    first.shared.flush()
    for budget, want in ((64, 20), (3, 12)):  # room for the whole chain; for 3 of its 5 blocks
        second = cache_on(tmp_path, budget_blocks=budget)
        got, n, handle = second.prepare(tokens + [7], None)
        assert n == want and second.stats()["store_hit_tokens"] == want
        keys, _ = second.store.gather(handle.block_ids)
        assert all(torch.equal(keys[..., 4 * i : 4 * i + 4, :], kv_of(i)[0]) for i in range(want // 4))
        second.commit(handle, tokens + [7], got)
        second.check_integrity()
