"""fp32 projections on the CPU through oneDNN's prepacked GEMM, with plain F.linear as the reference.

torch's F.linear on the CPU calls MKL's sgemm on the weight as stored. On the 2-core AMD EPYC (AVX2)
kvtool is built on, that is slow for the few rows a decode step has: all 120 SmolLM2 projections
take ~30 ms at 1 row and ~50 ms at 8 rows (the head 8 ms and 20 ms), where the bytes they read
allow ~25 ms either way. oneDNN's linear over a weight reordered once into its blocked layout
(`torch.ops.mkldnn._reorder_linear_weight`, what torch.compile's CPU freezing uses) takes ~24 ms
and ~31 ms (head 5 ms and 7 ms), and is no slower at prefill sizes. Results differ from
F.linear only by summation order (~1e-4 on SmolLM2's projections).

The reordered weight is an opaque oneDNN tensor beside the dense one, which stays: the HF-named
parameters are views of it, and the reference and int4 packing read it. So
packing costs one more copy of the projection and head weights in host memory.
It is on by default on x86_64, where it was measured. `KVTOOL_CPU_GEMM=0` keeps plain F.linear (to
compare, or where oneDNN misbehaves); `KVTOOL_CPU_GEMM=1` turns it on elsewhere too (arm64, where
F.linear may already be fast).
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

HINT_ROWS = 8  # the row count oneDNN picks its weight layout for; 1-64 rows all ran within 5% of their best
ENV = "KVTOOL_CPU_GEMM"


@dataclass
class PackedWeight:
    """dense [N, K] fp32 (the values); packed: the same in oneDNN's layout (opaque, for packed_linear only)."""

    dense: torch.Tensor
    packed: torch.Tensor

    @property
    def nbytes(self) -> int:
        """Bytes one product reads (the packed copy holds the same values)."""
        return self.dense.nbytes

    @property
    def shape(self) -> torch.Size:
        return self.dense.shape


@functools.cache
def _op_works() -> str | None:
    """None when this torch build's oneDNN linear runs and agrees with F.linear, else why not."""
    if not torch.backends.mkldnn.is_available():
        return f"torch {torch.__version__} was built without oneDNN"
    try:
        gen = torch.Generator().manual_seed(0)
        w, x = torch.randn(48, 32, generator=gen), torch.randn(3, 32, generator=gen)
        y = torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(w, HINT_ROWS), None,
                                               "none", [], "")
    except (RuntimeError, AttributeError) as exc:
        return f"oneDNN linear is unavailable here: {str(exc).splitlines()[0]}"
    if not torch.allclose(y, F.linear(x, w), atol=1e-4, rtol=1e-4):
        return "oneDNN linear disagrees with F.linear on this machine"
    return None


def unsupported(weight: torch.Tensor) -> str | None:
    """None when `weight` can be packed here, else why not; ValueError for a malformed KVTOOL_CPU_GEMM."""
    mode = os.environ.get(ENV, "auto")
    if mode not in ("auto", "0", "1"):
        raise ValueError(f"{ENV} must be 0, 1 or unset; got {mode!r}")
    if mode == "0":
        return f"{ENV}=0"
    if mode == "auto" and platform.machine().lower() not in ("x86_64", "amd64"):
        return f"on by default on x86_64 only (this is {platform.machine()}; {ENV}=1 turns it on)"
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2:
        return f"oneDNN packing takes 2-D fp32 CPU weights; got {weight.dtype} {tuple(weight.shape)} on " \
               f"{weight.device.type}"
    return _op_works()


def pack(weight: torch.Tensor) -> PackedWeight:
    reason = unsupported(weight)
    if reason:
        raise ValueError(reason)
    dense = weight.detach()
    return PackedWeight(dense, torch.ops.mkldnn._reorder_linear_weight(dense, HINT_ROWS))


def packed_linear(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W.T + bias through oneDNN; other dtypes, and inputs that need gradients, take the reference."""
    if x.dtype != torch.float32 or (x.requires_grad and torch.is_grad_enabled()) or x.shape[-1] != w.shape[1]:
        return F.linear(x, w.dense, bias)
    return torch.ops.mkldnn._linear_pointwise(x, w.packed, bias, "none", [], "")


def packed_linear_reference(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The same product through F.linear over the dense values."""
    return F.linear(x, w.dense, bias)


class PackedLinear(nn.Module):
    """An nn.Linear whose product runs through `product` over a packed copy of its weight (packed_linear
    here; quant.Int4Linear swaps in the int4 product); weight and bias keep their HF names."""

    product = staticmethod(packed_linear)

    def __init__(self, dense: nn.Linear, packed):
        super().__init__()
        self.weight, self.bias, self.packed = dense.weight, dense.bias, packed
        self.in_features, self.out_features = dense.in_features, dense.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x, self.packed, self.bias)
