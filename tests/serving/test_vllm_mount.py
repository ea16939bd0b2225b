"""kvtool.integrations.vllm.mount: what the connector builds from kv_transfer_config alone (no vLLM, tiny models): its
settings, checked; the model's RoPE without weights, equal to the runner's; skill blocks placed with re-rotated
keys; each tensor-parallel rank's share of the KV heads (TP = 1, 2 and 4) and its own store layout."""

from __future__ import annotations

import importlib

import pytest
import torch

from kvtool.cache.kvfile import rope_info, setup_of
from kvtool.integrations.vllm.mount import MountSettings, RopeFrame, Shelf, rank_heads, store_layout
from kvtool.errors import InvalidParameterError
from kvtool.skills.block import compile_ids, save_block
from kvtool.testing.tiny import tiny_checkpoint, tiny_config, tiny_runner


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    tiny_checkpoint("llama", folder)
    return tiny_runner("llama", folder)


@pytest.mark.parametrize("extra,message", [
    ({"blocks": "x", "colour": 1}, "unknown kv_connector_extra_config key(s) ['colour']"),
    ({"repair": "recompute_attended:ratio=0.1"}, "the connector computes nothing itself"),
    ({"skill_min_tokens": -1}, "skill_min_tokens must be a whole number >= 0"),
    ({"kv_store_bytes": 0}, "kv_store_bytes must be a positive whole number"),
    ({"kv_store_block": "16"}, "kv_store_block must be a positive whole number"),
    ({"blocks": "no/such/folder"}, "is neither a folder nor a .kvb file"),
    ({"load": "later"}, "load must be 'auto', 'async' or 'sync'"),
])
def test_settings_say_what_is_wrong(extra, message):
    with pytest.raises(InvalidParameterError, match=None) as err:
        MountSettings.from_extra(extra)
    assert message in str(err.value)


def test_a_folder_without_compiled_blocks_names_the_compile_command(tmp_path):
    (tmp_path / "haiku.md").write_text("---\nname: haiku\ndescription: x\n---\nbody\n")
    with pytest.raises(InvalidParameterError) as err:
        MountSettings.from_extra({"blocks": str(tmp_path)})
    assert "kvtool skill compile" in str(err.value)
    assert MountSettings.from_extra({}).repair == "none" and MountSettings.from_extra({}).kv_store_block == 16


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_the_rope_frame_is_the_runners_rope(family, tmp_path):
    tiny_checkpoint(family, tmp_path)
    runner, frame = tiny_runner(family, tmp_path), RopeFrame(tiny_config(family))
    assert rope_info(frame) == rope_info(runner)
    keys = torch.randn(runner.spec.num_layers, 2, 5, runner.spec.head_dim)
    from kvtool.skills.repair import rerotate_layers

    assert torch.equal(rerotate_layers(frame, keys, 9), rerotate_layers(runner, keys, 9))


def test_a_placed_block_has_the_keys_a_prefill_there_computes(llama, tmp_path):
    """Layer 0's keys depend on the token and its position only: the block placed at 7 has the keys of a prefill
    of 7 other tokens and then the block."""
    ids = list(range(30, 50))
    block = compile_ids(llama, ids, setup_of(runner=llama, name="tiny"), "b")
    path = save_block(block, tmp_path / "b.kvb")
    frame = RopeFrame(tiny_config("llama"))
    shelf = Shelf.load([str(path)], frame)
    assert shelf.index.find([1, 2] + ids + [3])[0].start == 2 and shelf.summary()[0]["tokens"] == 20
    keys, values = shelf.kv("b", frame, (0, 2), 3, 20, 7, torch.float32)  # tokens 3.. of the block, placed at 7
    ref = llama.new_cache()
    llama.prefill(list(range(60, 67)) + ids, ref)
    want, _ = ref.stacked(7 + 3, 7 + 20)
    assert keys.shape == (3, 2, 17, 16) and torch.allclose(keys[0], want[0], atol=1e-4)
    assert torch.equal(values, block.values[:, :, 3:20])


def test_a_block_for_another_model_is_refused(llama, tmp_path):
    block = compile_ids(llama, [5, 6, 7], setup_of(runner=llama, name="tiny"), "b")
    path = save_block(block, tmp_path / "b.kvb")
    with pytest.raises(InvalidParameterError) as err:
        Shelf.load([str(path)], RopeFrame(tiny_config("qwen2")))
    assert "was compiled for another model" in str(err.value)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_each_rank_places_and_stores_its_own_kv_heads(llama, tmp_path, tp):
    """2 KV heads: TP 1 holds both, TP 2 one each, TP 4 replicates each head on two ranks (as vLLM does). The ranks'
    shares put together are the whole block; each distinct share has its own store layout."""
    block = compile_ids(llama, list(range(30, 42)), setup_of(runner=llama, name="tiny"), "b")
    path = save_block(block, tmp_path / "b.kvb")
    frame = RopeFrame(tiny_config("llama"))
    shelf = Shelf.load([str(path)], frame)
    whole, _ = shelf.kv("b", frame, (0, 2), 0, 12, 4, torch.float32)
    shares = [rank_heads(2, tp, rank) for rank in range(tp)]
    assert shares == {1: [(0, 2)], 2: [(0, 1), (1, 2)], 4: [(0, 1), (0, 1), (1, 2), (1, 2)]}[tp]
    got = {h: shelf.kv("b", frame, h, 0, 12, 4, torch.float32)[0] for h in shares}
    assert torch.equal(torch.cat([got[h] for h in sorted(got)], dim=1), whole)
    layouts = {h: store_layout({"model": "tiny"}, frame.spec, torch.float32, 16, h) for h in got}
    assert len({x.root for x in layouts.values()}) == len(got)
    assert all(x.shape == (2, 3, h[1] - h[0], 16, 16) for h, x in layouts.items())
    with pytest.raises(ValueError):
        rank_heads(3, 2, 0)  # 3 heads do not split over 2 ranks


def test_the_transfer_config_is_written_without_vllm_and_names_the_connector():
    import importlib.util

    from kvtool.integrations.vllm.mount import transfer_config

    config = transfer_config({"blocks": "b"})
    assert config["kv_connector_extra_config"] == {"blocks": "b"} and config["kv_role"] == "kv_both"
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed: the named class cannot be imported here")
    module = importlib.import_module(config["kv_connector_module_path"])
    assert isinstance(getattr(module, config["kv_connector"]), type)
