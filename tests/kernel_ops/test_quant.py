"""4-bit projection weights: the grid, the int4 kernel against its fp32 reference, and errors."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvtool.kernels import cpu_decode, cpu_gemm
from kvtool.kernels.quant import (EXACT_TOP, GROUP, MAX_ROWS, Int4Linear, head_logits, int4_linear,
                                  int4_linear_reference, quantize_int4, unsupported)
from kvtool.testing.ops import ops_of


def grid_codes(w, packed):
    """The codes q (as floats) that reproduce packed.dense from its scales and zeros, [N, K]."""
    n, k = w.shape
    s, z = packed.scales_zeros.float().unbind(-1)  # [K/32, N]
    s, z = s.T.repeat_interleave(GROUP, 1), z.T.repeat_interleave(GROUP, 1)
    return (packed.dense - z) / s + 8


def test_quantize_puts_every_weight_on_its_groups_grid_within_half_a_step():
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(0))
    packed = quantize_int4(w)
    q = grid_codes(w, packed)
    assert torch.allclose(q, q.round(), atol=1e-3) and q.min() >= -1e-3 and q.max() <= 15 + 1e-3
    step = packed.scales_zeros[..., 0].float().T.repeat_interleave(GROUP, 1)
    # half a step of rounding, plus the zero's bf16 rounding (2^-9 of the group's midpoint)
    assert ((packed.dense - w).abs() <= 0.5 * step + 2e-2 * step + 1e-6).all()
    assert packed.dense.shape == w.shape and packed.dense.dtype == w.dtype
    assert packed.nbytes == 48 * 128 // 2 + (128 // GROUP) * 48 * 2 * 2


def test_weights_already_on_a_4bit_grid_come_back_unchanged():
    """GGUF Q4_0/Q4_1 weights are (q - 8) * scale + zero per 32; re-quantizing them loses nothing
    when scale and zero are bf16 values (in general only their rounding to bf16)."""
    g = torch.Generator().manual_seed(1)
    n, k = 16, 96
    q = torch.randint(0, 16, (n, k // GROUP, GROUP), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15  # each group spans the grid, as Q4_1's min/max quantization makes it
    scale = (torch.rand(n, k // GROUP, 1, generator=g) * 0.02 + 0.001).bfloat16().float()
    zero = (torch.randn(n, k // GROUP, 1, generator=g) * 0.01).bfloat16().float()
    w = ((q - 8) * scale + zero).reshape(n, k)
    assert torch.equal(quantize_int4(w).dense, w)


@pytest.fixture(params=["torch", "cpp"])
def kernel(request, monkeypatch):
    """Which int4 kernel and bf16 head pass run: torch's, or the C++ decode ops' once they are loaded."""
    if request.param == "cpp" and cpu_decode.unavailable() is not None:
        pytest.skip("the C++ decode ops do not build here")
    monkeypatch.setattr(cpu_decode, "_loaded", request.param == "cpp")
    return request.param


@pytest.mark.parametrize("rows", [1, 2, MAX_ROWS])
def test_int4_kernel_matches_the_fp32_reference(rows, kernel):
    g = torch.Generator().manual_seed(rows)
    packed = quantize_int4(torch.randn(96, 64, generator=g))
    x, bias = torch.randn(rows, 64, generator=g), torch.randn(96, generator=g)
    ops = ops_of(lambda: int4_linear(x, packed, bias))
    out, ref = int4_linear(x, packed, bias), int4_linear_reference(x, packed, bias)
    assert out.dtype == torch.float32 and out.shape == (rows, 96)
    # torch's: bf16 activations and output, ~2^-8 relative error on each product; the C++ gemv_q4: x in
    # 16 bits per group of 32, sums and output in fp32
    assert (out - ref).abs().max() <= (2e-2 if kernel == "torch" else 2e-4) * ref.abs().max()
    assert not torch.equal(out, ref)  # the kernel ran, not the dense path
    assert ("kvtool_cpu::gemv_q4" in ops) == (kernel == "cpp")


def test_more_rows_than_the_kernel_takes_use_the_dense_values_exactly():
    g = torch.Generator().manual_seed(3)
    packed = quantize_int4(torch.randn(32, 64, generator=g))
    x = torch.randn(1, MAX_ROWS + 1, 64, generator=g)
    assert torch.equal(int4_linear(x, packed), torch.nn.functional.linear(x, packed.dense))


def test_int4_linear_module_keeps_the_hf_names():
    dense = nn.Linear(64, 32, bias=True)
    layer = Int4Linear(dense, quantize_int4(dense.weight.detach()))
    assert sorted(dict(layer.named_parameters())) == ["bias", "weight"]
    x = torch.randn(2, 64)
    assert torch.allclose(layer(x), int4_linear(x, layer.packed, dense.bias))


def test_weights_the_kernel_cannot_take_are_refused_with_the_reason():
    assert "K of 32" in unsupported(torch.zeros(16, 40))
    assert "N a multiple of 16" in unsupported(torch.zeros(8, 64))
    assert "CPU only" in unsupported(torch.zeros(16, 64, device="meta"))
    with pytest.raises(ValueError, match=r"K of 32; got \(16, 40\)"):
        quantize_int4(torch.zeros(16, 40))


def test_bf16_head_gives_exact_top_logits_and_close_others(kernel):
    g = torch.Generator().manual_seed(4)
    dense, h = torch.randn(1000, 64, generator=g), 3 * torch.randn(2, 1, 64, generator=g)
    got, want = head_logits(h, dense, dense.bfloat16()), torch.nn.functional.linear(h, dense)
    assert got.shape == want.shape == (2, 1, 1000) and got.dtype == torch.float32
    # the top of the bf16 pass is recomputed; it holds the true top well inside its boundary
    top = want.topk(EXACT_TOP // 2, -1).indices
    assert torch.allclose(got.gather(-1, top), want.gather(-1, top), rtol=0, atol=1e-4)
    assert ((got - want).abs() <= 1e-4).sum(-1).min() >= EXACT_TOP
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    rest = (got - want).abs().max()
    assert 0 < rest <= 2e-2 * want.abs().max()  # the bf16 pass, outside the recomputed top
    many = torch.randn(MAX_ROWS + 1, 64, generator=g)
    assert torch.equal(head_logits(many, dense, dense.bfloat16()), torch.nn.functional.linear(many, dense))


@pytest.mark.skipif(cpu_gemm._op_works() is not None, reason="needs oneDNN's packed linear")
def test_with_a_packed_dense_head_few_rows_take_the_bf16_pass(kernel):
    """torch's bf16 pass reads the head once per row, so with a packed dense head only one row takes it; the
    C++ gemv streams the bf16 head once for up to GEMV_MAX_ROWS rows."""
    g = torch.Generator().manual_seed(5)
    dense = torch.randn(1000, 64, generator=g)
    wide = cpu_gemm.pack(dense)
    most = 1 if kernel == "torch" else cpu_decode.GEMV_MAX_ROWS
    few, more = 3 * torch.randn(most, 64, generator=g), 3 * torch.randn(most + 1, 64, generator=g)
    got = head_logits(few, dense, dense.bfloat16(), wide)
    assert not torch.equal(got, cpu_gemm.packed_linear(few, wide))
    assert torch.equal(got.argmax(-1), F.linear(few, dense).argmax(-1))
    assert torch.equal(head_logits(more, dense, dense.bfloat16(), wide), cpu_gemm.packed_linear(more, wide))
