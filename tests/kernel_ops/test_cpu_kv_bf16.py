"""The C++ CPU ops over a bf16 KV cache (EngineConfig.kv_dtype): keys and values rounded to bf16 as written (to
nearest even, as torch rounds), widened to fp32 as read, against torch over the same rounded values."""

import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from kvtool.kernels import cpu_decode, cpu_gemm
from kvtool.models.rope import apply_rope
from tests.kernel_ops.test_cpu_decode import reference_attend
from tests.kernel_ops.test_cpu_prefill import assert_same_bits, at_threads

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None or cpu_gemm._op_works() is not None,
                                reason="needs a C++ compiler and oneDNN's packed linear")
BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def ops():
    assert cpu_decode.unavailable() is None
    return torch.ops.kvtool_cpu


def rope_rows(gen, rows, d):
    angles = torch.rand(rows, d // 2, generator=gen) * 6
    return torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)


@pytest.mark.parametrize("hq,hkv,d,slot,qk_norm", [(9, 3, 64, 40, False), (9, 3, 64, 700, False),
                                                   (16, 8, 128, 257, True), (4, 2, 24, 5, False)])
def test_attend_over_bf16_kv_equals_sdpa_over_the_widened_kv(ops, hq, hkv, d, slot, qk_norm):
    """A decode step over bf16 buffers writes the new K/V rounded as torch rounds them, and attends as SDPA does over
    the widened keys (its own rounded ones included); d = 24 takes the columns past the vectors one by one. (Shared bf16
blocks read in place: test_cpu_decode.py, test_attend_reads_shared_blocks_in_place_with_the_same_bits.)"""
    gen = torch.Generator().manual_seed(slot + d)
    slots = [slot, slot // 2, 3]
    keys = [torch.randn(1, hkv, s + 9, d, generator=gen).to(BF16) for s in slots]
    values = [torch.randn(1, hkv, s + 9, d, generator=gen).to(BF16) for s in slots]
    qkv = torch.randn(len(slots), (hq + 2 * hkv) * d, generator=gen)
    cos, sin = rope_rows(gen, len(slots), d)
    norms = (torch.rand(d, generator=gen) + 0.5, torch.rand(d, generator=gen) + 0.5) if qk_norm else (None, None)
    before = [(k.clone(), v.clone()) for k, v in zip(keys, values)]
    got = ops.attend(qkv, keys, values, slots, cos, sin, *norms, 1e-6, hq, hkv, [], [], 0)
    for r, s in enumerate(slots):
        _, k_new, v_new = reference_attend(qkv[r : r + 1], keys[r].float(), values[r].float(), s, cos[r], sin[r],
                                           *norms, 1e-6, hq, hkv)
        torch.testing.assert_close(keys[r][0, :, s].float(), k_new.to(BF16).float(), atol=1e-5, rtol=2 ** -7)
        assert torch.equal(values[r][0, :, s], v_new.to(BF16))  # the same fp32 values, rounded by torch
        others = [i for i in range(keys[r].shape[2]) if i != s]
        assert torch.equal(keys[r][:, :, others], before[r][0][:, :, others])
        assert torch.equal(values[r][:, :, others], before[r][1][:, :, others])
        q = qkv[r : r + 1].view(hq + 2 * hkv, d)[:hq]  # SDPA over exactly the keys the op wrote and read
        q = apply_rope(q if not qk_norm else F.rms_norm(q, (d,), norms[0], 1e-6), cos[r], sin[r])
        ks, vs = keys[r][0, :, : s + 1].float(), values[r][0, :, : s + 1].float()
        want = F.scaled_dot_product_attention(q[None, :, None], ks[None], vs[None], enable_gqa=True).reshape(1, -1)
        torch.testing.assert_close(got[r : r + 1], want, atol=2e-5, rtol=1e-4)


def test_rope_qkv_rounds_to_nearest_even_as_torch_does(ops):
    """rope_qkv into bf16 buffers and blocks writes the bits of torch's rounding of what it writes in fp32: ties to
    even, overflow to inf, NaN, signed zeros, subnormals."""
    hq, hkv, d, t, slot, gen = 4, 2, 16, 6, 13, torch.Generator().manual_seed(0)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen) * 3
    edge = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 3.4e38, float("inf"), float("nan"), -0.0,
                         1e-40, -3e-39, 65504.0, 2 ** -133, 1.0 - 2 ** -9, 255.5, 0.0, -1e30, 7.0])
    qkv[:, (hq + hkv) * d : (hq + hkv + 1) * d] = edge  # the first value head of every token
    cos, sin = rope_rows(gen, t, d)
    base, layers = 16, 2
    fp32 = (torch.zeros(1, hkv, slot + t - base + 2, d), torch.zeros(1, hkv, slot + t - base + 2, d))
    block32 = [torch.zeros(2, layers, hkv, 16, d)]
    ops.rope_qkv(qkv, *fp32, slot, cos, sin, None, None, 1e-6, hq, hkv, block32, 1, base)
    bf = tuple(x.to(BF16) for x in fp32)
    block16 = [b.to(BF16) for b in block32]
    ops.rope_qkv(qkv, *bf, slot, cos, sin, None, None, 1e-6, hq, hkv, block16, 1, base)
    for ours, theirs in ((bf[0], fp32[0]), (bf[1], fp32[1]), (block16[0], block32[0])):
        nan = theirs.isnan()  # a NaN stays one (torch's own conversions write different NaN bits)
        assert torch.equal(ours.isnan(), nan)
        assert torch.equal(ours[~nan].view(torch.int16), theirs[~nan].to(BF16).view(torch.int16))
    assert torch.isnan(block16[0][1, 1, 0, slot, 5]) and block16[0][1, 1, 0, slot, 3] == float("inf")
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        ops.rope_qkv(qkv, *(x.half() for x in fp32), slot, cos, sin, None, None, 1e-6, hq, hkv, [], 1, 0)


@pytest.mark.parametrize("hq,hkv,d,t,slot,blocks", [(9, 3, 64, 64, 200, 0), (9, 3, 64, 40, 8, 3),
                                                  (16, 8, 128, 33, 70, 4), (4, 2, 24, 50, 20, 4)])
def test_prefill_attention_over_bf16_kv_equals_masked_attention(ops, hq, hkv, d, t, slot, blocks):
    """prefill_attention over bf16 blocks and buffers against SDPA with the causal mask over the widened keys: the
    same bits at any thread count and at eight lanes as at the widest vectors the build has."""
    from kvtool.models.layers import causal_mask

    gen = torch.Generator().manual_seed(t * slot + blocks)
    base, layers = 16 * blocks, 3
    shared = [torch.randn(2, layers, hkv, 16, d, generator=gen).to(BF16) for _ in range(blocks)]
    own_k, own_v = (torch.randn(1, hkv, slot + t - base + 3, d, generator=gen).to(BF16) for _ in range(2))
    q = torch.randn(t, hq, d, generator=gen) * 2
    outs = at_threads(lambda: ops.prefill_attention(q, shared, 1, own_k, own_v, base, slot))
    assert_same_bits(outs)
    assert torch.equal(outs[0], ops.prefill_attention(q, shared, 1, own_k, own_v, base, slot, 8))
    keys, values = (torch.cat([*(b[kv, 1] for b in shared), mine[0, :, : slot + t - base]], 1)[None].float()
                    for kv, mine in ((0, own_k), (1, own_v)))
    want = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys, values,
                                          attn_mask=causal_mask(t, slot + t, "cpu"), enable_gqa=True)
    torch.testing.assert_close(outs[0], want[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="of one dtype"):
        ops.prefill_attention(q, shared, 1, own_k, own_v.float(), base, slot)
