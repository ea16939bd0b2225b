"""Logit parity with transformers on tiny random Qwen3 / Qwen2 / Llama / Gemma 3 checkpoints."""

import pytest
import torch

from kvtool.testing.tiny import tiny_checkpoint, tiny_runner

FAMILIES = ["qwen3", "qwen2", "llama", "gemma3"]


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = tiny_checkpoint(request.param, folder)
    return hf, tiny_runner(request.param, folder)


def hf_logprobs(hf, ids):
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)


def test_full_prefill_matches_transformers(pair):
    hf, runner = pair
    ids = torch.randint(0, 256, (200,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = torch.log_softmax(runner.prefill(ids, runner.new_cache(), logits="all"), -1)
    assert ours.shape == (200, 256)
    assert (ours - hf_logprobs(hf, ids)).abs().max().item() <= 1e-4


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_and_decode_match(pair, chunk):
    hf, runner = pair
    ids = torch.randint(0, 256, (90,), generator=torch.Generator().manual_seed(2)).tolist()
    cache = runner.new_cache(capacity=8)  # forces the buffers to grow mid-prefill
    ours = torch.log_softmax(runner.prefill(ids[:80], cache, chunk=chunk, logits="all"), -1)
    rows = [ours]
    for t in ids[80:]:
        rows.append(torch.log_softmax(runner(torch.tensor([t]), cache), -1))
    ours = torch.cat(rows)
    assert cache.offset == 90
    assert (ours - hf_logprobs(hf, ids)).abs().max().item() <= 1e-4


def test_greedy_generation_matches_transformers(pair):
    hf, runner = pair
    prompt = [5, 17, 33, 2, 99]
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    cache = runner.new_cache()
    logits = runner.prefill(prompt, cache)
    got = []
    for _ in range(24):
        got.append(int(logits.argmax(-1)))
        logits = runner(torch.tensor([got[-1]]), cache)
    assert got == want


def test_taps_see_pre_and_post_rope_tensors(pair):
    _, runner = pair
    seen = []
    runner.prefill([1, 2, 3, 4], runner.new_cache(), tap=seen.append)
    assert [t.layer for t in seen] == list(range(runner.spec.num_layers))
    tap = seen[0]
    assert tap.q.shape[-2] == 4 and tap.k_rot.shape == tap.k.shape
    assert torch.allclose(tap.k[..., 0, :], tap.k_rot[..., 0, :], atol=1e-6)  # position 0: no rotation
    assert not torch.allclose(tap.k[..., 1, :], tap.k_rot[..., 1, :])
    assert torch.equal(tap.cache[0].keys, tap.k_rot)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_hf_s_order_of_operations_bit_for_bit(dtype):
    """fp32 takes the one-op form with the weight inside; it must give the bits of HF's normalise-then-scale."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from kvtool.models.runner import RMSNorm

    ours, hf = RMSNorm(96, 1e-6).to(dtype), Qwen3RMSNorm(96, 1e-6).to(dtype)
    with torch.no_grad():
        weight = torch.randn(96, generator=torch.Generator().manual_seed(1)).to(dtype)
        ours.weight.copy_(weight)
        hf.weight.copy_(weight)
        x = (3 * torch.randn(2, 7, 96, generator=torch.Generator().manual_seed(2))).to(dtype)
        assert torch.equal(ours(x), hf(x))
