"""Per-layer cache interface invariants under property tests."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtool.cache.kv import KVCache, LayerKV
from kvtool.errors import CacheFormatError

H, D = 2, 4

ops = st.lists(st.one_of(
    st.tuples(st.just("append"), st.integers(1, 40)),
    st.tuples(st.just("trim"), st.integers(0, 50)),
    st.tuples(st.just("truncate"), st.floats(0, 1)),
    st.tuples(st.just("roundtrip"), st.just(0)),
    st.tuples(st.just("span"), st.tuples(st.floats(0, 1), st.floats(0, 1))),
), max_size=30)


def shared_start(blocks: int, filled: int) -> tuple[LayerKV, list[torch.Tensor], list[torch.Tensor]]:
    """Layer 1 of a two-layer paged cache over `blocks` shared blocks of 3 tokens, then `filled` tokens of its
    page; its tokens as [2, H, D] keys and values, and copies of the blocks (which must stay as they are)."""
    gen = torch.Generator().manual_seed(blocks * 10 + filled)
    shared = [torch.randn(2, 2, H, 3, D, generator=gen) for _ in range(blocks)]
    own = torch.randn(2, 2, H, 3, D, generator=gen)
    cache = KVCache.paged(shared, own, filled, 3 * blocks)
    tokens = [blk[:, 1, :, i] for blk in shared for i in range(3)] + [own[:, 1, :, i] for i in range(filled)]
    return cache.layers[1], tokens, [blk.clone() for blk in shared]


@settings(max_examples=150, deadline=None)
@given(ops, st.integers(0, 3), st.integers(0, 3))
def test_layer_matches_a_plain_list_model(operations, blocks, filled):
    """From empty buffers, or from shared blocks and some tokens of its own page (KVCache.paged)."""
    layer, model_k, kept = shared_start(blocks, filled) if blocks else (LayerKV(H, D, torch.float32, "cpu", capacity=4),
                                                                        [], [])
    shared = list(layer.blocks)
    counter = 0
    for op, arg in operations:
        if op == "append":
            k = torch.arange(counter, counter + arg * H * D, dtype=torch.float32).reshape(1, H, arg, D)
            counter += arg * H * D
            keys, values = layer.append(k, -k)
            model_k += [torch.stack([k[0, :, i], -k[0, :, i]]) for i in range(arg)]
            assert keys.shape == (1, H, len(model_k), D) and layer.base == 0  # a writer copies the blocks first
        elif op == "trim":  # drop the last arg tokens
            layer.truncate(max(layer.offset - arg, 0))
            model_k = model_k[: max(len(model_k) - arg, 0)]
        elif op == "truncate":
            n = int(arg * len(model_k))
            layer.truncate(n)
            model_k = model_k[:n]
        elif op == "span":
            lo, hi = sorted(int(a * len(model_k)) for a in arg)
            k, v = layer.span(lo, hi)
            assert k.shape == v.shape == (1, H, hi - lo, D)
            assert hi == lo or torch.equal(torch.stack([k[0], v[0]]), torch.stack(model_k[lo:hi], 2))
        else:
            layer = LayerKV.from_state(layer.state())
        assert layer.offset == len(model_k)
        assert layer.nbytes == 2 * len(model_k) * H * D * 4
        assert layer.capacity >= layer.offset
        if model_k:
            want = torch.stack(model_k, dim=2)  # [2, H, T, D]
            assert torch.equal(layer.keys[0], want[0]) and torch.equal(layer.values[0], want[1])
    assert all(torch.equal(a, b) for a, b in zip(shared, kept))


def test_truncate_past_end_is_refused():
    layer = LayerKV(H, D, torch.float32, "cpu")
    layer.append(torch.zeros(1, H, 3, D), torch.zeros(1, H, 3, D))
    with pytest.raises(ValueError, match="cannot truncate a cache of 3 tokens to 5"):
        layer.truncate(5)


def test_cache_state_roundtrip_and_clone_are_independent():
    cache = KVCache.empty(3, H, D, torch.float32, "cpu", capacity=2)
    cache.append_all(torch.randn(3, H, 5, D), torch.randn(3, H, 5, D))
    restored = KVCache.from_state(cache.state())
    assert restored.offset == 5 and restored.nbytes == cache.nbytes
    for a, b in zip(cache.layers, restored.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    clone = cache.clone()
    clone.truncate(2)
    clone.append_all(torch.ones(3, H, 1, D), torch.ones(3, H, 1, D))
    assert cache.offset == 5 and not torch.equal(cache[0].keys[:, :, 2], clone[0].keys[:, :, 2])
    ks, vs = cache.stacked(1, 4)
    assert ks.shape == (3, H, 3, D) and torch.equal(ks[1], cache[1].keys[0, :, 1:4])


def test_broken_state_is_a_clear_error():
    cache = KVCache.empty(2, H, D, torch.float32, "cpu")
    cache.append_all(torch.randn(2, H, 3, D), torch.randn(2, H, 3, D))
    state = cache.state()
    del state["layers.1.values"]
    with pytest.raises(CacheFormatError, match="layers.1.values"):
        KVCache.from_state(state)
    state = cache.state()
    state["layers.1.keys"] = state["layers.1.keys"][:, :, :2]
    with pytest.raises(CacheFormatError):
        KVCache.from_state(state)


def test_a_paged_cache_moves_each_full_page_to_its_blocks():
    """Tokens written as the C++ ops write them (at offset - base of the buffers, after reserve()) fill the page;
    a full page becomes a block by reference when the next token needs room, and the cache reads in order."""
    shared = [torch.randn(2, 2, H, 3, D)]
    first = torch.randn(2, 2, H, 3, D)
    cache = KVCache.paged(list(shared), first, 1, 3)
    want = [shared[0][:, :, :, i] for i in range(3)] + [first[:, :, :, 0]]
    for t in range(7):
        cache.reserve(cache.offset + 1)
        token = torch.full((2, 2, H, D), float(t))
        for i, layer in enumerate(cache.layers):
            slot = layer.offset - layer.base
            layer.buffers[0][0, :, slot], layer.buffers[1][0, :, slot] = token[0, i], token[1, i]
            layer.offset += 1
        want.append(token)
    blocks = cache.layers[1].blocks
    assert len(blocks) == 3 and blocks[0] is shared[0] and blocks[1] is first and cache.layers[1].base == 9
    assert cache.offset == 11 and cache.own_tokens == 8 and cache.layers[0].page is not first
    keys, values = cache.stacked()
    assert torch.equal(keys, torch.stack([w[0] for w in want], 2))
    assert torch.equal(values, torch.stack([w[1] for w in want], 2))


paged_ops = st.lists(st.one_of(
    st.tuples(st.just("append"), st.integers(1, 9)),
    st.tuples(st.just("truncate"), st.floats(0, 1)),
    st.tuples(st.just("write"), st.lists(st.floats(0, 0.999), min_size=1, max_size=6)),
    st.tuples(st.just("fork"), st.just(0)),
), max_size=25)


@settings(max_examples=150, deadline=None)
@given(paged_ops, st.integers(0, 3), st.integers(0, 2))
def test_a_paged_cache_writes_through_its_blocks_and_never_into_a_borrowed_one(operations, blocks, filled):
    """append_all, truncate and write (skill composition and edits) on a paged cache over borrowed blocks keep it
    paged, read back as a list of tokens would, and leave every block it borrowed (or lent to a fork) as it was."""
    gen = torch.Generator().manual_seed(blocks * 10 + filled)
    shared = [torch.randn(2, 2, H, 3, D, generator=gen) for _ in range(blocks)]
    page = torch.randn(2, 2, H, 3, D, generator=gen)
    cache = KVCache.paged(list(shared), page, filled, 3 * blocks, take=lambda: torch.full((2, 2, H, 3, D), -9.0))
    model = [blk[:, :, :, i] for blk in shared for i in range(3)] + [page[:, :, :, i] for i in range(filled)]
    lent, counter = [(blk, blk.clone()) for blk in shared], 0
    for op, arg in operations:
        if op == "append":
            kv = torch.arange(counter, counter + 2 * 2 * H * arg * D, dtype=torch.float32).reshape(2, 2, H, arg, D)
            counter += kv.numel()
            cache.append_all(kv[0], kv[1])
            model += [kv[:, :, :, i] for i in range(arg)]
        elif op == "truncate":
            cache.truncate(int(arg * len(model)))
            model = model[: int(arg * len(model))]
        elif op == "write" and model:
            at = sorted({int(a * len(model)) for a in arg})
            kv = -torch.arange(counter, counter + 2 * 2 * H * len(at) * D, dtype=torch.float32).reshape(2, 2, H, -1, D)
            counter += kv.numel()
            for i, layer in enumerate(cache.layers):
                layer.write(torch.tensor(at), kv[0, i : i + 1], kv[1, i : i + 1])
            for j, t in enumerate(at):
                model[t] = kv[:, :, :, j]
        elif op == "fork":  # the fork takes the full blocks by reference; the cache may not write them any more
            fork = cache.fork()
            lent += [(blk, blk.clone()) for blk in fork.layers[0].blocks]
            assert all(a is b for a, b in zip(fork.layers[0].blocks, cache.layers[0].blocks))
        assert cache.offset == len(model) and all(layer.page is cache.layers[0].page for layer in cache.layers)
        if model:
            keys, values = cache.stacked()
            want = torch.stack(model, 3)  # [2, L, H, T, D]
            assert torch.equal(keys, want[0]) and torch.equal(values, want[1])
    assert all(torch.equal(blk, kept) for blk, kept in lent)
