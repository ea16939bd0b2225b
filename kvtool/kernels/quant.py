"""4-bit projection weights and a bf16 output head for CPU decode, with dense fp32 references.

At batch 1 a CPU decode step reads every weight once and does two flops with it, so memory
bandwidth sets the speed: SmolLM2-135M in fp32 is 540 MB a token, which the two cores' fp32
GEMMs stream at 11.5 GB/s (F.linear) to 17.5 GB/s (oneDNN, kvtool.kernels.cpu_gemm). With its
projections in 4 bits (plus a bf16 scale and zero per 32 weights) and its head in bf16 it reads
123 MB.

Int4: per output row, groups of 32 input columns; w = (q - 8) * scale + zero with q in 0..15.
The codes come from round-to-nearest between the group's min and max, then scale and zero are
refit by least squares. This is torch's CPU int4 layout (`_weight_int4pack_mm_for_cpu`, bf16
scales and activations). GGUF Q4_0/Q4_1 weights already sit on such a grid, so for them the
re-quantization only rounds scale and zero to bf16. Against SmolLM2's Q4_1 weights that moves a
weight by 0.17% of its norm (min/max alone: 0.39%). GGUF Q5_0/Q6_K weights lose real precision.
Every packed weight keeps `dense`, the exact values it stands for, in the model's dtype. Calls
with more than MAX_ROWS rows (prefill, many streams) multiply by it, through `wide` (the same
values packed for oneDNN, kvtool.kernels.cpu_gemm) when ModelRunner.quantize_int4 made one; the
fp32 reference multiplies by `dense` too.

The output head is not packed in 4 bits: that moved SmolLM2's next-token distribution 70x more
than all 210 projections together (KL 0.059 vs 0.0008). It runs in bf16, whose output rounds
logits of ~20 to steps of 0.125 and would flip near-ties, so the EXACT_TOP highest logits are then
recomputed in fp32 from the dense head: those, and so the argmax, are exact; the rest carry bf16
rounding (~2^-8 relative). (The CPU kernels take bf16 or fp16 activations; fp16 runs 15x slower
on AVX2.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvtool.kernels import cpu_gemm

GROUP = 32
# At more rows per call than this the dense fp32 GEMM beats the int4 kernel (2 cores, AVX2, a
# 3072 x 576 weight: 2.1x faster at 2-4 rows, even at 8, 0.73x at 16, 0.43x at 512; against
# oneDNN's packed fp32 GEMM over all of SmolLM2's projections: 2x at 1 row, even at 8, 0.7x at 16).
MAX_ROWS = 8
EXACT_TOP = 64  # head logits recomputed in fp32 per row
# The bf16 head pass reads the whole head once per row on AVX2 (no bf16 dot instructions), so with a
# oneDNN-packed dense head at hand it only pays at one row: SmolLM2's head took 4.7 ms against 5.3 dense
# at 1 row, 8.3 against 5.2 at 2 and 32 against 7.5 at 8.
HALF_HEAD_MAX_ROWS = 1


@dataclass
class Int4Weight:
    """dense [N, K] in the model's dtype; packed [N, K/2] uint8 in the kernel's tiled layout;
    scales_zeros [K/32, N, 2] bf16."""

    dense: torch.Tensor
    packed: torch.Tensor
    scales_zeros: torch.Tensor
    wide: cpu_gemm.PackedWeight | None = None  # dense, packed for oneDNN: the product above MAX_ROWS rows

    @property
    def nbytes(self) -> int:
        """Bytes one small-batch product reads."""
        return self.packed.numel() + self.scales_zeros.numel() * 2


def unsupported(weight: torch.Tensor) -> str | None:
    """None when `weight` can be packed here, else why not."""
    if weight.device.type != "cpu":
        return f"int4 weights run on the CPU only (this model is on {weight.device.type})"
    if weight.dim() != 2 or weight.shape[1] % GROUP:
        return f"int4 weights need [N, K] with K a multiple of {GROUP}; got {tuple(weight.shape)}"
    if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return f"torch {torch.__version__} has no CPU int4 kernel (_weight_int4pack_mm_for_cpu)"
    return None


def quantize_int4(weight: torch.Tensor) -> Int4Weight:
    """weight [N, K] on the nearest 4-bit grid of each group of 32 columns."""
    reason = unsupported(weight)
    if reason:
        raise ValueError(reason)
    n, k = weight.shape
    w = weight.detach().float().reshape(n, k // GROUP, GROUP)
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    step = ((hi - lo) / 15).clamp_min(1e-10)
    q = ((w - lo) / step).round_().clamp_(0, 15)
    # least-squares scale and zero for these codes, then rounded to bf16 and the codes re-rounded on that grid
    qc, wc = q - q.mean(-1, keepdim=True), w - w.mean(-1, keepdim=True)
    var = (qc * qc).sum(-1, keepdim=True)
    scale = torch.where(var > 0, (qc * wc).sum(-1, keepdim=True) / var.clamp_min(1e-12), step)
    scale = scale.clamp_min(1e-10).bfloat16().float()
    zero = (w.mean(-1, keepdim=True) - scale * (q.mean(-1, keepdim=True) - 8)).bfloat16().float()
    q = ((w - zero) / scale + 8).round_().clamp_(0, 15)
    dense = ((q - 8) * scale + zero).reshape(n, k).to(weight.dtype)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.reshape(n, k).to(torch.int32), 1)
    scales_zeros = torch.stack([scale[..., 0], zero[..., 0]], -1).transpose(0, 1).contiguous().bfloat16()
    return Int4Weight(dense, packed, scales_zeros)


def int4_linear(x: torch.Tensor, w: Int4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W.T + bias in x's dtype: the int4 kernel for up to MAX_ROWS rows (x rounded to
    bf16, sums in fp32, output rounded to bf16), the dense values for more."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] > MAX_ROWS:
        return F.linear(x, w.dense, bias) if w.wide is None else cpu_gemm.packed_linear(x, w.wide, bias)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows.bfloat16(), w.packed, GROUP, w.scales_zeros)
    y = y.to(x.dtype).reshape(*x.shape[:-1], w.dense.shape[0])
    return y if bias is None else y + bias


def int4_linear_reference(x: torch.Tensor, w: Int4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The same product in fp32 over the dense values: the slow path int4_linear is tested against."""
    return F.linear(x.float(), w.dense.float(), None if bias is None else bias.float()).to(x.dtype)


def head_logits(h: torch.Tensor, dense: torch.Tensor, half: torch.Tensor,
                wide: cpu_gemm.PackedWeight | None = None) -> torch.Tensor:
    """fp32 logits [..., V] of h [..., hidden] through the head (dense [V, hidden], half its bf16 copy).
    Up to MAX_ROWS rows (HALF_HEAD_MAX_ROWS when `wide`, the dense head packed for oneDNN, is given): a
    bf16 pass, then the EXACT_TOP highest recomputed in fp32; more rows: dense (through `wide` if given)."""
    rows = h.reshape(-1, h.shape[-1])
    if rows.shape[0] > (MAX_ROWS if wide is None else HALF_HEAD_MAX_ROWS):
        return (F.linear(h, dense) if wide is None else cpu_gemm.packed_linear(h, wide)).float()
    logits = F.linear(rows.bfloat16(), half).float()
    top = logits.topk(min(EXACT_TOP, logits.shape[-1]), -1).indices  # [M, k]
    exact = torch.einsum("mh,mkh->mk", rows.float(), dense[top].float())
    return logits.scatter_(-1, top, exact).reshape(*h.shape[:-1], -1)


class Int4Linear(cpu_gemm.PackedLinear):
    """An nn.Linear whose product runs through int4_linear over its Int4Weight `packed`."""

    product = staticmethod(int4_linear)
