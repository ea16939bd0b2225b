"""BlockStore: put/gather round trip, adopt and page, free, byte accounting, and the index+store protocol."""

import random

import pytest
import torch

from kvtool.cache.index import PrefixIndex
from kvtool.cache.manager import PrefixCache
from kvtool.cache.store import BlockPool, BlockStore
from kvtool.errors import PoolExhausted

L, H, B, D = 2, 3, 4, 5


def make_store(dtype=torch.float32):
    return BlockStore(num_layers=L, num_kv_heads=H, head_dim=D, block_size=B, dtype=dtype, device="cpu")


def random_kv(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, H, B, D, generator=g), torch.randn(L, H, B, D, generator=g)


def test_put_gather_round_trip_concatenates_along_the_sequence():
    store = make_store()
    kvs = {i: random_kv(i) for i in (7, 3, 9)}
    store.put(7, *kvs[7])
    store.put(3, list(kvs[3][0]), list(kvs[3][1]))  # per-layer lists work too
    store.put(9, *kvs[9])
    keys, values = store.gather([9, 7, 3])
    assert keys.shape == values.shape == (L, H, 3 * B, D)
    assert torch.equal(keys, torch.cat([kvs[i][0] for i in (9, 7, 3)], dim=2))
    assert torch.equal(values, torch.cat([kvs[i][1] for i in (9, 7, 3)], dim=2))
    store.check_integrity()


def test_stored_blocks_are_copies_in_the_store_dtype():
    store = make_store(dtype=torch.float16)
    k, v = random_kv(0)
    store.put(0, k, v)
    k.zero_()  # the caller's buffer is reused for the next request
    keys, _ = store.gather([0])
    assert keys.dtype == torch.float16
    assert torch.equal(keys, random_kv(0)[0].half())


def test_free_contains_and_byte_accounting():
    store = make_store(dtype=torch.bfloat16)
    assert store.bytes_per_block == 2 * L * H * B * D * 2
    assert store.nbytes == 0
    for i in range(3):
        store.put(i, *random_kv(i))
    assert store.ids() == {0, 1, 2}
    assert store.nbytes == 3 * store.bytes_per_block
    store.free([0, 2])
    assert store.ids() == {1} and store.nbytes == store.bytes_per_block
    store.check_integrity()


def test_adopt_keeps_a_written_block_itself_and_a_page_copies_a_tail():
    store = make_store()
    store.put(0, *random_kv(0))
    page = store.page((0, 3))  # a request reuses 3 tokens of block 0 and writes the rest itself
    assert page.shape == store.block_shape and torch.equal(page[0, :, :, :3], random_kv(0)[0][:, :, :3])
    page[:, :, :, 3:] = 1.0
    store.adopt(1, page)
    assert store.tensors([1])[0] is page and store.nbytes == 2 * store.bytes_per_block
    store.check_integrity()
    with pytest.raises(ValueError, match="already stored"):
        store.adopt(1, store.page(None))
    with pytest.raises(ValueError, match=r"must be torch.float32 \[2, 2, 3, 4, 5\] on cpu, got torch.float16"):
        store.adopt(2, store.page(None).half())
    with pytest.raises(ValueError, match="a tail reads 0..3 tokens of a block, not 4"):
        store.page((0, 4))
    with pytest.raises(KeyError, match=r"blocks \[7\] are not stored"):
        store.page((7, 1))


def test_blocks_come_from_one_pool_and_a_slot_returns_when_its_block_is_gone():
    blocks = BlockPool((2, L, H, B, D), torch.float32, "cpu", 2 * make_store().bytes_per_block + 1)
    store = BlockStore(L, H, D, B, torch.float32, "cpu", blocks)
    assert blocks.blocks == 2 and len(blocks.spare) == 2
    a, b = store.take(), blocks.take()  # the store's blocks and the requests' pages come from the same pool
    pool = a.untyped_storage().data_ptr()
    assert b.untyped_storage().data_ptr() == pool and a.data_ptr() != b.data_ptr() and not blocks.spare
    with pytest.raises(PoolExhausted, match=r"the KV pool's 2 blocks \(8 tokens\) are all in use; raise"):
        store.take()  # every slot in use: never an allocation beyond the pool
    store.adopt(0, a)
    del a
    assert not blocks.spare  # the store still holds it
    store.free([0])
    assert len(blocks.spare) == 1  # its last reference went: the slot is spare again
    store.put(1, *random_kv(1))  # put() takes a slot too
    assert not blocks.spare and store.tensors([1])[0].untyped_storage().data_ptr() == pool
    del b
    assert len(blocks.spare) == 1
    store.check_integrity()
    with pytest.raises(ValueError, match=r"pool's blocks are torch.float32 \[2, 2, 3, 4, 5\], not torch.float16"):
        BlockStore(L, H, D, B, torch.float16, "cpu", blocks)
    unsized = BlockPool((2, L, H, B, D), torch.float32, "cpu")  # a standalone store's: a block at a time
    taken = [unsized.take() for _ in range(3)]
    assert unsized.blocks == 0 and len({t.data_ptr() for t in taken}) == 3 and not unsized.spare


def test_a_pool_whose_one_allocation_fails_says_so(monkeypatch):
    pool = BlockPool((2, L, H, B, D), torch.float32, "cpu", 3 * make_store().bytes_per_block)

    def refused(*shape, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(torch, "empty", refused)  # (as under a strict overcommit policy)
    with pytest.raises(PoolExhausted, match=r"the KV pool of 2,880 bytes could not be allocated \(Default.*\); lower"):
        pool.take()


def test_a_full_pool_evicts_what_the_prefix_cache_may_drop_before_it_refuses():
    pool = BlockPool((2, L, H, B, D), torch.float32, "cpu", 4 * make_store().bytes_per_block)
    cache = PrefixCache(L, H, D, budget_bytes=4 * make_store().bytes_per_block, block_size=B, pool=pool)
    tokens = list(range(4 * B))
    assert cache.import_chain(tokens, lambda i: random_kv(i), pin=tokens[: 2 * B]) == 4 * B and not pool.spare
    held = [pool.take(), pool.take()]  # the two unpinned blocks are evicted for them, the last first
    assert cache.stats()["blocks"] == 2 and cache.stats()["evictions"] == 2 and not pool.spare
    with pytest.raises(PoolExhausted, match="4 blocks"):
        pool.take()  # what is left is pinned
    cache.check_integrity()
    del held
    assert len(pool.spare) == 2


def test_misuse_raises_clear_errors():
    store = make_store()
    store.put(0, *random_kv(0))
    with pytest.raises(ValueError, match="already stored"):
        store.put(0, *random_kv(0))
    with pytest.raises(ValueError, match=r"2 layers of \[H=3, B=4, D=5\]"):
        store.put(1, torch.zeros(L, H, B + 1, D), torch.zeros(L, H, B + 1, D))
    with pytest.raises(KeyError, match="not stored"):
        store.gather([0, 1])
    with pytest.raises(KeyError, match="listed twice"):
        store.free([0, 0])
    store.free([0])
    with pytest.raises(KeyError, match="freed twice"):
        store.free([0])
    with pytest.raises(ValueError, match="positive ints, got block_size=0"):
        BlockStore(L, H, D, 0, torch.float32, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_round_trip():
    store = BlockStore(L, H, D, B, torch.float16, "cuda")
    k, v = random_kv(0)
    store.put(0, k, v)  # CPU input is copied to the device
    keys, _ = store.gather([0])
    assert keys.device.type == "cuda" and torch.equal(keys.cpu(), k.half())
    store.check_integrity()


def fake_kv(tokens, start):
    """Deterministic KV for tokens[start:start+B]: each position depends on its whole prefix,
    like real attention KV does, so a wrongly shared block shows up as a mismatch."""
    keys = torch.empty(L, H, B, D)
    for p in range(start, start + B):
        keys[:, :, p - start, :] = float(hash(tuple(tokens[: p + 1])) % 10007)
    return keys, -keys


def test_index_and_store_together_serve_correct_kv():
    rng = random.Random(1)
    index = PrefixIndex(block_size=B, capacity_blocks=12)
    store = make_store()
    docs = [[rng.randrange(5) for _ in range(40)] for _ in range(3)]
    running = []
    for step in range(400):
        tokens = rng.choice(docs)[: rng.randrange(0, 40)] + [rng.randrange(5) for _ in range(rng.randrange(0, 6))]
        hit = index.match(tokens)
        if hit:  # what a cache hit copies into the request's KV cache
            keys, values = store.gather(hit)
            expected = [fake_kv(tokens, i * B) for i in range(len(hit))]
            assert torch.equal(keys, torch.cat([k for k, _ in expected], dim=2))
            assert torch.equal(values, torch.cat([v for _, v in expected], dim=2))
        result = index.insert(tokens)
        store.free(result.evicted)
        for i, block_id in result.new:
            store.put(block_id, *fake_kv(tokens, i * B))
        index.acquire(result.block_ids)
        running.append(result.block_ids)
        if len(running) > 3:
            store.free(index.release(running.pop(0)))
        if step % 150 == 149:
            store.free(index.reset())
        assert store.ids() == index.resident_ids()
        assert store.nbytes <= index.capacity_blocks * store.bytes_per_block
    store.check_integrity()
    index.check_integrity()
    assert index.stats.hit_tokens > 0
