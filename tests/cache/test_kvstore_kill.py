"""kill -9 at random moments while a prefix cache publishes its blocks to a folder store (8 seeded cycles), with
this process reading the store at the same time: a reader never finds a torn block, every chain whose publish
completed is there whole after the kill, with its KV, and another cache on the store adopts it. The KV has
SmolLM2-135M's shape (30 layers, 3 KV heads, head_dim 64, 16-token blocks: 737 KB a block), so kills land inside
writes, fsyncs and renames alike."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kvtool.cache.blockrecord import decode
from kvtool.cache.dirstore import DirStore
from kvtool.cache.manager import PrefixCache
from kvtool.cache.shared import SharedBlocks

CYCLES = 8
SHAPE = (30, 3, 64, 16)  # layers, kv heads, head dim, block size
SETUP = {"model": "kill-test", "config_hash": "0", "tokenizer_hash": "0", "dtype": "float32", "rope": "{}"}
ROOT = Path(__file__).resolve().parents[2]


def kv_of(chain: list[int], i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block i's KV, a function of the tokens up to its end (so any process knows what it must read)."""
    seed = hash(tuple(chain[: (i + 1) * SHAPE[3]])) % 2**20  # cheap to make: the writer spends its time writing
    kv = torch.arange(2 * SHAPE[0] * SHAPE[1] * SHAPE[3] * SHAPE[2], dtype=torch.float32).add_(seed)
    kv = kv.reshape(2, SHAPE[0], SHAPE[1], SHAPE[3], SHAPE[2])
    return kv[0], kv[1]


def cache_on(root: str) -> PrefixCache:
    layers, heads, dim, block = SHAPE
    cache = PrefixCache(layers, heads, dim, budget_bytes=2 * layers * heads * dim * block * 4 * 64, block_size=block)
    cache.shared = SharedBlocks.for_cache(root, None, SETUP, cache.store)
    return cache


def child(root: str, seed: int) -> None:
    """Publish chains forever, printing each chain once its publish returned."""
    cache, rng = cache_on(root), random.Random(seed)
    print("ready", flush=True)
    while True:
        chain = [rng.randrange(1, 49152) for _ in range(SHAPE[3] * rng.randrange(1, 6))]
        cache.import_chain(chain, lambda i: kv_of(chain, i))
        cache.shared.save(chain, list(enumerate(cache.index.match(chain, record=False))), cache.store)
        cache.shared.flush()
        print("published", json.dumps(chain), flush=True)


def read_all(store: DirStore) -> int:
    """Read every record listed now; each one found is whole. Returns how many were read."""
    n = 0
    for key in list(store.keys()):
        record = store.get(key)
        assert record is None or decode(record, key) is not None, f"a reader saw a torn block {key}"
        n += record is not None
    return n


@pytest.mark.slow
def test_kill_9_of_a_publishing_cache_leaves_every_published_chain_readable(tmp_path):
    root, rng = str(tmp_path / "store"), random.Random(7)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    published: list[list[int]] = []
    for cycle in range(CYCLES):
        out, err = tmp_path / f"child{cycle}.out", tmp_path / f"child{cycle}.err"
        with open(out, "wb") as fh, open(err, "wb") as eh:
            proc = subprocess.Popen([sys.executable, "-c", "import sys; from tests.cache.test_kvstore_kill import "
                                     "child; child(sys.argv[1], int(sys.argv[2]))", root, str(cycle)],
                                    stdout=fh, stderr=eh, cwd=ROOT, env=env)
        deadline = time.monotonic() + 120
        while not out.read_text().startswith("ready"):
            assert proc.poll() is None, f"cycle {cycle}: the writer failed:\n{err.read_text()[-3000:]}"
            assert time.monotonic() < deadline, "the writer did not start in time"
            time.sleep(0.05)
        store, until = DirStore(root), time.monotonic() + rng.uniform(0.3, 2.5)
        while time.monotonic() < until:  # read while it writes
            read_all(store)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        assert "Traceback" not in err.read_text(), err.read_text()[-3000:]
        published += [json.loads(line.split(" ", 1)[1]) for line in out.read_text().split("\n")[1:-1]]
        store.check_integrity()
        assert read_all(store) == store.usage()["blocks"]
    assert len(published) >= CYCLES, f"only {len(published)} chains published: the kills hit too early to test"
    reader = cache_on(root)
    for chain in published:  # every completed publish is there whole, with its KV, for another cache
        cache, n, handle = reader.prepare(chain + [1], None)
        assert n == len(chain)
        keys, values = reader.store.gather(handle.block_ids)
        for i in range(len(chain) // SHAPE[3]):
            want = kv_of(chain, i)
            part = slice(i * SHAPE[3], (i + 1) * SHAPE[3])
            assert torch.equal(keys[:, :, part], want[0]) and torch.equal(values[:, :, part], want[1])
        reader.commit(handle, chain + [1], cache)
    reader.check_integrity()
