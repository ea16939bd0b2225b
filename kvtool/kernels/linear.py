"""x @ W.T (+ bias) for any kind of weight a runner holds: plain, oneDNN-packed or int4."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvtool.kernels import cpu_gemm, quant


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, or the product for a weight ModelRunner.quantize_int4() or pack_cpu_gemm() packed."""
    if isinstance(weight, quant.Int4Weight):
        return quant.int4_linear(x, weight, bias)
    if isinstance(weight, cpu_gemm.PackedWeight):
        return cpu_gemm.packed_linear(x, weight, bias)
    return F.linear(x, weight, bias)
