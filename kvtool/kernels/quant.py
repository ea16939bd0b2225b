"""4-bit projection weights and a bf16 output head for CPU decode, with dense fp32 references.

At batch 1 a CPU decode step reads every weight once and does two flops with it, so memory
bandwidth sets the speed. With its projections in 4 bits (plus a bf16 scale and zero per 32 weights)
and its head in bf16, SmolLM2-135M reads 123 MB a token instead of fp32's 540 MB.

Int4: per output row, groups of 32 input columns; w = (q - 8) * scale + zero with q in 0..15.
The codes come from round-to-nearest between the group's min and max, then scale and zero are
refit by least squares and rounded to bf16. GGUF Q4_0/Q4_1 weights already sit on such a grid, so
for them the re-quantization only rounds scale and zero to bf16. Against SmolLM2's Q4_1 weights that
moves a weight by 0.17% of its norm (min/max alone: 0.39%). GGUF Q5_0/Q6_K weights lose real
precision. Every packed weight stands for `dense`, the exact values of its grid, in the model's dtype
(held, or made from the codes once ModelRunner.hold_weights_once dropped them). Calls with more than
MAX_ROWS rows (prefill, many streams; BF16_WIDE_MAX_ROWS with a bf16 `wide`) multiply by `wide`, the
same values packed for oneDNN (kvtool.kernels.cpu_gemm) when ModelRunner.quantize_int4 made one, else
by `dense`; the fp32 reference multiplies by `dense`. `wide` is in bf16 where oneDNN's bf16 GEMM runs
(AMX or AVX-512 BF16; wide_dtype), as `weights="bf16"` is: x, the weights and the product rounded to
bf16, so prefill and batched decode run faster and the copy is half the size; in fp32 elsewhere
(AVX2), where it multiplies by the grid values exactly. The runner's precision then reads
"float32/int4+bf16", so KV computed either way is never mixed.

Two kernels take the products of up to MAX_ROWS rows. Once the C++ decode ops are loaded
(kvtool.kernels.cpu_decode; kvtool.load loads them for CPU models), `gemv_q4`: x goes in at 16 bits
per group of 32 (each value moved by at most 2^-16 of its group's largest), integer dots, sums in
fp32. Otherwise torch's `_weight_int4pack_mm_for_cpu`, which rounds x and its output to bf16 (2^-9
of each value). gemv_q4 takes x at 16 bits rather than 8 (llama.cpp's Q8 vectors) because SmolLM2's
activations have outliers that take a group's range: 8 bits moved the next-token distribution ~50x
more. gemv_q4's time grows with the rows (the unpacked codes are shared by up to four rows, but the
dots are per row), so it pays most at one row.

The output head is not packed in 4 bits: that moved SmolLM2's next-token distribution 70x more
than all 210 projections together (KL 0.059 vs 0.0008). Decode makes its logits in two passes: a
first pass over a smaller copy, then the EXACT_TOP highest recomputed in fp32 from the dense head:
those, and so the argmax, are exact; the rest carry the copy's rounding. With the C++ ops loaded the
copy is 8 bits per weight with a scale per 32 (Int8Weight, GGUF's Q8_0 grid: the Q8_0 heads of the
test models come back within 2^-11 of each value, bf16 is off by up to 2^-9) through `gemv_q8` (fp32 x
and sums) for up to GEMV_MAX_ROWS rows: half the bytes of bf16, and the head is most of what a 4-bit
decode step reads. Otherwise it is bf16, through F.linear in bf16 (bf16 x and output too; torch's CPU
kernels take bf16 or fp16 activations, and fp16 runs 15x slower on AVX2).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvtool.kernels import cpu_decode, cpu_gemm

GROUP = 32
# At more rows per call than this oneDNN's packed fp32 GEMM over the dense values beats the int4 kernels (AVX2;
# docs/benchmarks.md, "kvtool.kernels.quant").
MAX_ROWS = 4
# Against oneDNN's bf16 GEMM (AMX), where `wide` is bf16, gemv_q4 wins at 1 and 2 rows and ties at 3; three
# rows stay with the int4 kernel, in one C++ call.
BF16_WIDE_MAX_ROWS = 3
EXACT_TOP = 64  # head logits recomputed in fp32 per row
# torch's bf16 head pass reads the whole head once per row on AVX2 (no bf16 dot instructions), so with a
# oneDNN-packed dense head at hand it only pays at one row. (The C++ gemv reads it once for all rows.)
HALF_HEAD_MAX_ROWS = 1


@dataclass
class Int4Weight:
    """held: the dense [N, K] values in the model's dtype (None once ModelRunner.hold_weights_once dropped them:
    `dense` then makes them anew from the codes, exactly); packed [N, K/2] uint8 in torch's tiled layout and
    scales_zeros [K/32, N, 2] bf16 for torch's kernel; the same codes row by row (codes [N, K/2]: byte 16g + i
    holds column 32g + i in its low nibble, column 32g + 16 + i in its high one) and scale_zero [N, 2, K/32]
    bf16 for the C++ decode ops' gemv_q4 (kvtool.kernels.cpu_decode)."""

    held: torch.Tensor | None
    packed: torch.Tensor
    scales_zeros: torch.Tensor
    codes: torch.Tensor
    scale_zero: torch.Tensor
    wide: cpu_gemm.PackedWeight | None = None  # dense, packed for oneDNN (fp32 or bf16): the products of many rows

    @property
    def dense(self) -> torch.Tensor:
        """The [N, K] values the grid stands for: the held copy, or fp32 values made from the codes."""
        return self.held if self.held is not None else unpack(self.codes, self.scale_zero)

    @dense.setter
    def dense(self, value: torch.Tensor) -> None:
        self.held = value

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.codes.shape[0], self.codes.shape[1] * 2))

    @property
    def nbytes(self) -> int:
        """Bytes one small-batch product reads."""
        return self.packed.numel() + self.scales_zeros.numel() * 2


def unpack(codes: torch.Tensor, scale_zero: torch.Tensor) -> torch.Tensor:
    """The fp32 [N, K] values of codes [N, K/2] and scale_zero [N, 2, K/32]: (q - 8) * scale + zero, computed as
    quantize_int4 computed them, so bit for bit the values it packed."""
    n, groups = codes.shape[0], scale_zero.shape[-1]
    pairs = codes.reshape(n, groups, GROUP // 2)
    q = torch.cat([pairs & 15, pairs >> 4], -1).float()  # [N, K/32, 32]
    scale, zero = scale_zero.float().unbind(1)  # [N, K/32] each
    return ((q - 8) * scale[..., None] + zero[..., None]).reshape(n, groups * GROUP)


def kernel_takes(w: Int4Weight, rows: int) -> bool:
    """Whether a product of `rows` rows runs an int4 kernel (else `wide`, or `dense`)."""
    return rows <= (BF16_WIDE_MAX_ROWS if w.wide is not None and w.wide.half else MAX_ROWS)


def unsupported(weight: torch.Tensor) -> str | None:
    """None when `weight` can be packed here, else why not."""
    if weight.device.type != "cpu":
        return f"int4 weights run on the CPU only (this model is on {weight.device.type})"
    if weight.dim() != 2 or weight.shape[1] % GROUP or weight.shape[0] % 16:
        return f"int4 weights need [N, K] with N a multiple of 16 and K of {GROUP}; got {tuple(weight.shape)}"
    if not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        return f"torch {torch.__version__} has no CPU int4 kernel (_weight_int4pack_mm_for_cpu)"
    return None


def wide_dtype(weight: torch.Tensor) -> torch.dtype | None:
    """The dtype of the oneDNN copy for products of more than MAX_ROWS rows: bf16 where oneDNN's bf16 GEMM runs,
    else fp32 where its fp32 one does, else None (F.linear over `dense`)."""
    if cpu_gemm.unsupported(weight) is not None:
        return None
    return torch.bfloat16 if cpu_gemm.unsupported(weight, torch.bfloat16) is None else torch.float32


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
    codes = q.to(torch.uint8)
    codes = (codes[..., :16] | (codes[..., 16:] << 4)).reshape(n, k // 2)
    scale_zero = torch.stack([scale[..., 0], zero[..., 0]], 1).bfloat16()  # [N, 2, K/32]
    return Int4Weight(dense, packed, scales_zeros, codes, scale_zero)


@dataclass
class Int8Weight:
    """An [N, K] weight in 8 bits: W[j, 32g + i] = codes[j, 32g + i] * scale[j, g], codes int8 in -127..127 and
    scale [N, K/32] fp32 (each group's largest magnitude over 127: GGUF's Q8_0 grid, so a Q8_0 weight keeps its
    values up to the rounding it was converted with). The head's first pass for a few rows (head_logits) reads
    it through the C++ ops' gemv_q8."""

    codes: torch.Tensor
    scale: torch.Tensor

    @property
    def nbytes(self) -> int:
        """Bytes one product reads."""
        return self.codes.numel() + self.scale.numel() * 4


def quantize_int8(weight: torch.Tensor, rows_at_once: int = 8192) -> Int8Weight:
    """weight [N, K] (K a multiple of 32) on the 8-bit grid of each group of 32 columns, `rows_at_once` rows at a
    time (no fp32 copy of the whole weight)."""
    n, k = weight.shape
    if k % GROUP:
        raise ValueError(f"int8 weights need K a multiple of {GROUP}; got {tuple(weight.shape)}")
    codes, scale = torch.empty(n, k, dtype=torch.int8), torch.empty(n, k // GROUP)
    for start in range(0, n, rows_at_once):
        w = weight[start : start + rows_at_once].detach().float().reshape(-1, k // GROUP, GROUP)
        s = w.abs().amax(-1) / 127
        q = (w / s.clamp_min(1e-30)[..., None]).round_().clamp_(-127, 127)
        codes[start : start + rows_at_once], scale[start : start + rows_at_once] = q.reshape(-1, k), s
    return Int8Weight(codes, scale)


def small_head(weight: torch.Tensor) -> Int8Weight | None:
    """The head's 8-bit copy for head_logits' first pass, or None where the C++ ops do not run or K is not a
    multiple of 32 (the bf16 copy serves then)."""
    return quantize_int8(weight) if weight.shape[1] % GROUP == 0 and cpu_decode.unavailable() is None else None


def int4_linear(x: torch.Tensor, w: Int4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W.T + bias in x's dtype: for up to MAX_ROWS rows (BF16_WIDE_MAX_ROWS with a bf16 `wide`)
    an int4 kernel, for more the dense values. The kernel is the C++ ops' gemv_q4 once they are loaded (x in
    16 bits per group of 32, sums in fp32), else torch's (x rounded to bf16, sums in fp32, output in bf16)."""
    rows = x.reshape(-1, x.shape[-1])
    if not kernel_takes(w, rows.shape[0]):
        if w.wide is None or x.dtype != torch.float32 or (x.requires_grad and torch.is_grad_enabled()):
            return F.linear(x, w.dense.to(x.dtype), bias)
        return cpu_gemm.packed_linear(x, w.wide, bias)
    if cpu_decode.loaded():
        y = torch.ops.kvtool_cpu.gemv_q4(rows.float().contiguous(), w.codes, w.scale_zero,
                                         None if bias is None else bias.float(), None)
        return y.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows.bfloat16(), w.packed, GROUP, w.scales_zeros)
    y = y.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])
    return y if bias is None else y + bias


def int4_linear_reference(x: torch.Tensor, w: Int4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The same product in fp32 over the dense values: the slow path int4_linear is tested against."""
    return F.linear(x.float(), w.dense.float(), None if bias is None else bias.float()).to(x.dtype)


def head_logits(h: torch.Tensor, dense: torch.Tensor, half: torch.Tensor,
                wide: cpu_gemm.PackedWeight | None = None, small: Int8Weight | None = None) -> torch.Tensor:
    """fp32 logits [..., V] of h [..., hidden] through the head (dense [V, hidden], half its bf16 copy, small
    its 8-bit copy). For few rows a first pass, then the EXACT_TOP highest recomputed in fp32: up to
    GEMV_MAX_ROWS rows through the C++ ops once they are loaded (gemv_q8 over `small` where given, else gemv
    over `half`), else up to MAX_ROWS (HALF_HEAD_MAX_ROWS when `wide`, the dense head packed for oneDNN, is
    given) through F.linear in bf16. More rows: dense (through `wide` if given)."""
    rows = h.reshape(-1, h.shape[-1])
    if cpu_decode.loaded() and rows.shape[0] <= cpu_decode.GEMV_MAX_ROWS:  # fp32 x, sums and output
        x = rows.float().contiguous()
        logits = (torch.ops.kvtool_cpu.gemv_q8(x, small.codes, small.scale) if small is not None
                  else torch.ops.kvtool_cpu.gemv(x, half, None, None))
    elif rows.shape[0] > (MAX_ROWS if wide is None else HALF_HEAD_MAX_ROWS):
        return (F.linear(h, dense) if wide is None else cpu_gemm.packed_linear(h, wide)).float()
    else:
        logits = F.linear(rows.bfloat16(), half).float()
    top = logits.topk(min(EXACT_TOP, logits.shape[-1]), -1).indices  # [M, k]
    exact = torch.einsum("mh,mkh->mk", rows.float(), dense[top].float())
    return logits.scatter_(-1, top, exact).reshape(*h.shape[:-1], -1)


class Int4Linear(cpu_gemm.PackedLinear):
    """An nn.Linear whose product runs through int4_linear over its Int4Weight `packed`."""

    product = staticmethod(int4_linear)
