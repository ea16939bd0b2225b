""".kvb files: round trip, tampering and truncation detected, blocks for another setup refused by name."""

import json

import pytest
import torch

from kvtool.errors import CacheFormatError
from kvtool.skills import load_block, save_block, setup_of
from kvtool.skills.block import SkillBlock


def test_round_trip(tiny_blocks, tmp_path):
    block = tiny_blocks[0]
    path = save_block(block, tmp_path / "alpha.kvb")
    back = load_block(path, expected_setup=block.setup)
    assert back.name == "alpha" and back.token_ids == block.token_ids and back.canonical_start == 5
    assert torch.equal(back.keys, block.keys) and torch.equal(back.values, block.values)
    assert back.setup == block.setup
    assert not path.with_name("alpha.kvb.tmp").exists()


def test_file_is_safetensors_with_metadata(tiny_blocks, tmp_path):
    from safetensors import safe_open

    path = save_block(tiny_blocks[0], tmp_path / "a.kvb")
    with safe_open(str(path), framework="pt") as fh:
        meta = fh.metadata()
        assert set(fh.keys()) == {"keys", "values", "token_ids"}
    assert meta["format"] == "kvtool.skill-block" and meta["keys_layout"] == "post_rope"
    assert meta["canonical_start"] == "5" and len(meta["sha256"]) == 64
    assert json.loads(meta["rope"])["rope"]["rope_theta"] == 1e6
    assert {"model", "config_hash", "tokenizer_hash", "dtype"} <= set(meta)


def _flip_byte(path, offset_from_end):
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0x40
    path.write_bytes(bytes(data))


def test_tampered_tensor_bytes_are_detected(tiny_blocks, tmp_path):
    path = save_block(tiny_blocks[0], tmp_path / "a.kvb")
    _flip_byte(path, 100)
    with pytest.raises(CacheFormatError, match="checksum mismatch"):
        load_block(path)


def test_tampered_metadata_is_detected(tiny_blocks, tmp_path):
    path = save_block(tiny_blocks[0], tmp_path / "a.kvb")
    data = path.read_bytes()
    assert b'"canonical_start":"5"' in data
    path.write_bytes(data.replace(b'"canonical_start":"5"', b'"canonical_start":"7"'))
    with pytest.raises(CacheFormatError, match="checksum mismatch"):
        load_block(path)


@pytest.mark.parametrize("keep", [0.5, 0.99])
def test_truncated_file_is_a_clear_error(tiny_blocks, tmp_path, keep):
    path = save_block(tiny_blocks[0], tmp_path / "a.kvb")
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(CacheFormatError, match="truncated, corrupted or not safetensors"):
        load_block(path)


def test_not_a_block(tmp_path):
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(tmp_path / "other.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CacheFormatError, match="not a kvtool skill block"):
        load_block(tmp_path / "other.safetensors")
    (tmp_path / "pickle.kvb").write_bytes(b"\x80\x04\x95garbage")
    with pytest.raises(CacheFormatError, match="not safetensors"):
        load_block(tmp_path / "pickle.kvb")
    with pytest.raises(CacheFormatError, match="no such skill block"):
        load_block(tmp_path / "missing.kvb")
    with pytest.raises(CacheFormatError, match="is a folder, not a skill block"):
        load_block(tmp_path)


def test_other_format_version_refused(tiny_blocks, tmp_path):
    from safetensors.torch import save_file

    save_file({"keys": torch.zeros(1)}, str(tmp_path / "v9.kvb"), metadata={"format": "kvtool.skill-block",
                                                                          "format_version": "9"})
    with pytest.raises(CacheFormatError, match="format version '9'"):
        load_block(tmp_path / "v9.kvb")


@pytest.mark.parametrize("field,label", [("model", "model"), ("tokenizer_hash", "tokenizer"),
                                         ("dtype", "dtype"), ("config_hash", "model config")])
def test_block_for_another_setup_is_refused_naming_the_mismatch(tiny_blocks, tmp_path, field, label):
    path = save_block(tiny_blocks[0], tmp_path / "a.kvb")
    expected = dict(tiny_blocks[0].setup, **{field: "something-else"})
    with pytest.raises(CacheFormatError, match=f"different setup: {label}: block has") as err:
        load_block(path, expected_setup=expected)
    assert "something-else" in str(err.value) and "kvtool skill compile" in str(err.value)


def test_rope_mismatch_refused_with_both_settings(tiny_blocks, tiny, tmp_path):
    rope = json.loads(tiny_blocks[0].setup["rope"])
    rope["rope"]["rope_theta"] = 10000.0
    expected = dict(tiny_blocks[0].setup, rope=json.dumps(rope, sort_keys=True))
    path = save_block(tiny_blocks[0], tmp_path / "a.kvb")
    with pytest.raises(CacheFormatError, match="RoPE setting: block has .*1000000.0.*this model has .*10000.0"):
        load_block(path, expected_setup=expected)


def test_check_runner_structural_errors(tiny_blocks, tiny):
    b = tiny_blocks[0]
    b.check_runner(tiny)
    short = SkillBlock("x", b.token_ids, b.keys[1:], b.values[1:], 0, b.setup)
    with pytest.raises(CacheFormatError, match="this model needs"):
        short.check_runner(tiny)
    half = SkillBlock("x", b.token_ids, b.keys.half(), b.values.half(), 0, b.setup)
    with pytest.raises(CacheFormatError, match="recompile it for this dtype"):
        half.check_runner(tiny)
    other = SkillBlock("x", b.token_ids, b.keys, b.values, 0, dict(b.setup, rope="{}"))
    with pytest.raises(CacheFormatError, match="compiled with RoPE"):
        other.check_runner(tiny)


def test_setup_of_bare_runner(tiny):
    s = setup_of(runner=tiny, name="t")
    assert s["model"] == "t" and s["tokenizer_hash"] == "none" and s["dtype"] == "float32"
