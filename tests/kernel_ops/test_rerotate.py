"""RoPE re-rotation: reference vs direct computation at the new position, round trips, Triton vs reference."""

import os

import pytest
import torch

from kvtool.kernels import pick_backend, rerotate, rerotate_, rerotate_reference, triton_available
from kvtool.testing.tiny import TINY_COMMON, tiny_checkpoint, tiny_runner

FAMILIES = ["qwen3", "qwen2", "llama"]


@pytest.fixture(scope="module", params=FAMILIES)
def runner(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    tiny_checkpoint(request.param, folder)
    return tiny_runner(request.param, folder)


@pytest.fixture(scope="module")
def yarn_runner(tmp_path_factory):
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(**TINY_COMMON, head_dim=32, tie_word_embeddings=True,
                      rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                       "original_max_position_embeddings": 128})
    folder = tmp_path_factory.mktemp("yarn")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(str(folder))
    return tiny_runner("qwen3", folder)


def keys_at(runner, ids, start):
    """Post-RoPE keys [L, H, T, D] of ids prefilled at positions start.. (nothing before them)."""
    cache = runner.new_cache(len(ids) + 1)
    runner.forward(torch.tensor(ids), cache, positions=torch.arange(start, start + len(ids)))
    return cache.stacked()[0]


IDS = list(range(17, 17 + 40))


@pytest.mark.parametrize("src,dst", [(0, 37), (100, 5), (3, 450)])
def test_relocated_key_equals_key_computed_at_new_position(runner, src, dst):
    moved = rerotate(keys_at(runner, IDS, src), dst - src, runner.inv_freq)
    direct = keys_at(runner, IDS, dst)
    scale = direct.abs().max().item()
    # layer 0 keys depend only on the token and its position: equal within fp32 rounding
    assert (moved[0] - direct[0]).abs().max().item() <= 2e-6 * scale * max(1, dst / 40)
    # attention is shift-invariant under RoPE, so a whole shifted sequence matches at every layer
    assert (moved - direct).abs().max().item() <= 1e-5 * scale * max(1, dst / 40)


def test_attention_scaling_is_not_applied_twice(yarn_runner):
    assert yarn_runner.rope_scaling != 1.0  # yarn scales cos/sin; a cached key already carries it
    moved = rerotate(keys_at(yarn_runner, IDS, 0), 300, yarn_runner.inv_freq)
    direct = keys_at(yarn_runner, IDS, 300)
    assert torch.allclose(moved[0], direct[0], rtol=1e-4, atol=1e-4 * direct.abs().max().item())


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("delta", [1, 513, 32000])
def test_round_trip_d_then_minus_d(runner, dtype, tol, delta):
    keys = keys_at(runner, IDS, 7).to(dtype)
    back = rerotate(rerotate(keys, delta, runner.inv_freq), -delta, runner.inv_freq)
    assert back.dtype == dtype and back.shape == keys.shape
    assert (back.float() - keys.float()).abs().max().item() <= tol * keys.float().abs().max().item()


def test_delta_zero_is_identity_and_in_place_matches(runner):
    keys = keys_at(runner, IDS, 3)
    assert torch.allclose(rerotate(keys, 0, runner.inv_freq), keys, atol=1e-7)
    expect = rerotate(keys, 99, runner.inv_freq)
    same = keys.clone()
    assert rerotate_(same, 99, runner.inv_freq) is same
    assert torch.equal(same, expect)


def test_reference_rejects_mismatched_head_dim(runner):
    with pytest.raises(ValueError, match="head_dim"):
        rerotate_reference(torch.zeros(2, 3, 4, 10), 1, runner.inv_freq)


def test_cpu_uses_the_reference_and_refuses_triton():
    x = torch.zeros(1, 2, 3, 8)
    assert pick_backend(x) == "reference"
    with pytest.raises(ValueError, match="triton backend needs"):
        pick_backend(x, "triton")
    with pytest.raises(ValueError, match="unknown rerotate backend"):
        pick_backend(x, "cuda-magic")


def _triton_vs_reference(device, dtype):
    from kvtool.kernels.rope_triton import rerotate_triton

    g = torch.Generator().manual_seed(0)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, 128, 2, dtype=torch.float) / 128))
    keys = torch.randn(3, 2, 37, 128, generator=g).to(device=device, dtype=dtype)  # 37: a ragged last tile
    for delta in (1, -5, 2048):
        ref = rerotate_reference(keys, delta, inv_freq.to(device))
        out = rerotate_triton(keys, delta, inv_freq.to(device))
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        assert (out.float() - ref.float()).abs().max().item() <= tol * 4
        inplace = keys.clone()
        rerotate_triton(inplace, delta, inv_freq.to(device), out=inplace)
        assert torch.equal(inplace, out)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or not triton_available(),
                    reason="needs triton with TRITON_INTERPRET=1 (CPU interpreter)")
def test_triton_kernel_in_interpreter():
    _triton_vs_reference("cpu", torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not triton_available(), reason="needs CUDA and triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernel_on_cuda(dtype):
    _triton_vs_reference("cuda", dtype)
    keys = torch.randn(4, 8, 64, 128, device="cuda", dtype=dtype)
    assert pick_backend(keys) == "triton"
