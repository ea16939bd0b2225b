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
), max_size=30)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_layer_matches_a_plain_list_model(operations):
    layer = LayerKV(H, D, torch.float32, "cpu", capacity=4)
    model_k: list[torch.Tensor] = []  # one [H, D] per token
    counter = 0
    for op, arg in operations:
        if op == "append":
            k = torch.arange(counter, counter + arg * H * D, dtype=torch.float32).reshape(1, H, arg, D)
            counter += arg * H * D
            keys, values = layer.append(k, -k)
            model_k += [k[0, :, i] for i in range(arg)]
            assert keys.shape == (1, H, len(model_k), D)
        elif op == "trim":
            dropped = layer.trim(arg)
            assert dropped == min(arg, len(model_k))
            model_k = model_k[: len(model_k) - dropped]
        elif op == "truncate":
            n = int(arg * len(model_k))
            layer.truncate(n)
            model_k = model_k[:n]
        else:
            layer = LayerKV.from_state(layer.state())
        assert layer.offset == len(model_k)
        assert layer.nbytes == 2 * len(model_k) * H * D * 4
        assert layer.capacity >= layer.offset
        if model_k:
            want = torch.stack(model_k, dim=1)[None]
            assert torch.equal(layer.keys, want)
            assert torch.equal(layer.values, -want)


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
