"""The Redis backend (kvtool.cache.redisstore) against a real redis-server (or valkey-server), started the way a
user would: a loopback port, maxmemory with allkeys-lru as the store's size limit. Skips where neither is installed
(.ci/run installs redis-server)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

import pytest
import torch

from kvtool.cache.kvstore import open_store
from kvtool.cache.manager import PrefixCache
from kvtool.cache.redisstore import RedisStore
from kvtool.cache.shared import SharedBlocks, describe_store
from kvtool.errors import InvalidParameterError
from tests.cache.test_kvstore import LAYOUT, SETUP, kv_of, record_for

SERVER = shutil.which("redis-server") or shutil.which("valkey-server")
pytestmark = pytest.mark.skipif(SERVER is None,
                                reason="no redis-server or valkey-server (apt-get install redis-server)")
MAXMEMORY = 48 << 20  # (the real-model test's prompt needs ~30 MB of SmolLM2 blocks)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    port, folder = free_port(), tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen([SERVER, "--port", str(port), "--bind", "127.0.0.1", "--maxmemory", str(MAXMEMORY),
                             "--maxmemory-policy", "allkeys-lru", "--save", "", "--appendonly", "no",
                             "--dir", str(folder)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)
    yield f"redis://127.0.0.1:{port}"
    proc.kill()
    proc.wait(10)


@pytest.fixture
def store(redis_url, request):
    db = request.node.name.__hash__() % 15 + 1  # a database of each test's own
    s = open_store(f"{redis_url}/{db}")
    s._call("FLUSHDB")
    yield s
    s.close()


def test_redis_store_publishes_once_and_reads_back(store):
    key, record = record_for(LAYOUT, list(range(8)), 1, size=5000)
    assert store.put(key, record) and not store.put(key, record)  # SET NX: the second writer changes nothing
    assert store.get(key) == record and store.get("ab" * 16) is None
    assert list(store.keys()) == [key]
    usage = store.usage()
    assert (usage["blocks"], usage["bytes"], usage["limit_bytes"], usage["policy"]) == (1, len(record), MAXMEMORY,
                                                                                       "allkeys-lru")
    store.touch([key])
    store.check_integrity()
    store.discard(key)
    assert store.get(key) is None and store.usage()["blocks"] == 0


def test_a_redis_server_evicts_to_its_maxmemory(store):
    for n in range(100):  # 100 blocks of 1 MB through a 48 MB server
        store.put(*record_for(LAYOUT, [n] * 4, 0, size=1 << 20))
    usage = store.usage()
    assert 0 < usage["blocks"] < 100 and usage["used_memory"] <= MAXMEMORY + (2 << 20)
    assert store.get(record_for(LAYOUT, [99] * 4, 0)[0]) is not None  # the newest stays
    store.check_integrity()


def test_a_second_cache_adopts_blocks_through_redis(store):
    def cache():
        c = PrefixCache(2, 2, 4, budget_bytes=1 << 20, block_size=4)
        c.shared = SharedBlocks(store, LAYOUT)
        return c

    first, tokens = cache(), list(range(200, 217))
    first.import_chain(tokens, kv_of)
    first.shared.save(tokens, list(enumerate(first.index.match(tokens, record=False))), first.store)
    first.shared.flush()
    second = cache()
    got, n, handle = second.prepare(tokens, None)
    assert n == 16 and second.stats()["store_hit_tokens"] == 16
    keys, values = second.store.gather(handle.block_ids)
    assert torch.equal(keys[..., 12:16, :], kv_of(3)[0]) and torch.equal(values[..., 4:8, :], kv_of(1)[1])
    second.commit(handle, tokens, got)
    info = describe_store(store)
    assert info["backend"] == "redis" and info["layouts"][0]["blocks"] == 4 and info["layouts"][0]["roots"] == 1


def test_redis_locations_that_cannot_work_are_refused_by_name(redis_url):
    with pytest.raises(InvalidParameterError, match="maxmemory"):
        open_store(redis_url, limit_bytes=1 << 20)
    with pytest.raises(InvalidParameterError, match="no Redis server answers"):
        RedisStore(f"redis://127.0.0.1:{free_port()}/0")


def test_a_writer_cut_off_mid_record_leaves_no_key(store):
    """A client killed while it sends a SET: the server never applies a command it did not receive whole."""
    key, record = record_for(LAYOUT, list(range(8)), 1, size=1 << 20)
    name = b"kvtool:block:" + key.encode()
    head = b"*4\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(name), name, len(record))
    with socket.create_connection(store.address) as s:
        s.sendall(b"*2\r\n$6\r\nSELECT\r\n$%d\r\n%d\r\n" % (len(str(store.db)), store.db))
        s.sendall(head + record[: len(record) // 2])  # then the connection drops, as at a kill -9
    time.sleep(0.2)
    assert store.get(key) is None and list(store.keys()) == []
    assert store.put(key, record) and store.get(key) == record  # the next writer publishes it whole


def test_cache_info_reads_a_redis_store(store, capsys):
    import json

    from kvtool.cli import main

    key, record = record_for(LAYOUT, list(range(8)), 0, size=100)
    store.put(key, record)
    assert main(["cache", "info", f"redis://127.0.0.1:{store.address[1]}/{store.db}", "--json"]) == 0
    described = json.loads(capsys.readouterr().out)
    assert (described["backend"], described["blocks"], described["limit_bytes"]) == ("redis", 1, MAXMEMORY)
    assert described["layouts"][0]["model"] == "store-test" and described["layouts"][0]["roots"] == 1
