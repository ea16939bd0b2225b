"""fp32 projections on the CPU through oneDNN's prepacked GEMM, with plain F.linear as the reference.

torch's F.linear on the CPU calls MKL's sgemm on the weight as stored, which is slow for the few rows a
decode step has: well below what the bytes it reads allow. oneDNN's linear over a weight reordered once
into its blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, what torch.compile's CPU freezing
uses) comes close to that bound, and is no slower at prefill sizes. Results differ from F.linear only by
summation order (~1e-4 on SmolLM2's projections).

The reordered weight is an opaque oneDNN tensor beside the dense one. Where its bytes are laid out as
[N / 64, K, 64] (checked value for value; that is what oneDNN picked for every kvtool shape on AVX2
and AVX-512), `blocked` views them as a plain tensor, which the decode gemv reads too
(kvtool.kernels.cpu_decode). The runner can then drop the dense copy (ModelRunner.hold_weights_once,
which kvtool.load calls): `dense` is remade from the blocked bytes when something asks for it, and the
weights are held once. Otherwise packing costs one more copy of the projection and head weights.
`weights="bf16"` (kvtool.load) packs bf16 copies instead: every projection runs on oneDNN's bf16 kernels (AMX
or AVX-512 BF16 where the CPU has them), x and the output rounded to bf16 (the C++ RMSNorm and silu_mul give x in
bf16, and silu_mul takes gate_up's in bf16: no fp32 copies converted), and the head's products of a few rows
(decode steps, a prompt's last token) run the C++ gemv over its bf16 values, widened exactly, so the logits
keep fp32's resolution. Its top-1 agreement with fp32 is in `kvtool bench decode`.
It is on by default on x86_64, where it was measured (docs/benchmarks.md, "kvtool.kernels.cpu_gemm").
`KVTOOL_CPU_GEMM=0` keeps plain F.linear (to compare, or where oneDNN misbehaves); `KVTOOL_CPU_GEMM=1` turns
it on elsewhere too (arm64, where F.linear may already be fast).
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform

import torch
import torch.nn.functional as F
from torch import nn

from kvtool.kernels import cpu_decode

HINT_ROWS = 8  # the row count oneDNN picks its weight layout for; 1-64 rows all ran within 5% of their best
ENV = "KVTOOL_CPU_GEMM"


class PackedWeight:
    """A [N, K] fp32 or bf16 weight in oneDNN's packed layout (`packed`, opaque, for packed_linear), its fp32 bytes
    as [N / 64, K, 64] (`blocked`) where oneDNN laid them out so, and the dense values until drop_dense()."""

    def __init__(self, dense: torch.Tensor, packed: torch.Tensor):
        self.held: torch.Tensor | None = dense
        self.shape, self.dtype = dense.shape, dense.dtype
        self.packed = packed

    @property
    def packed(self) -> torch.Tensor:
        return self._packed

    @packed.setter
    def packed(self, value: torch.Tensor) -> None:
        self._packed, self.blocked = value, blocked_view(value, self.held)

    @property
    def half(self) -> bool:
        return self.dtype == torch.bfloat16

    @property
    def dense(self) -> torch.Tensor:
        """The [N, K] fp32 values: the held copy (widened from bf16), or a new one made from the blocked bytes."""
        if self.held is not None:
            return self.held.float()
        if self.blocked is None:
            raise ValueError("this packed weight holds only oneDNN's opaque copy; its values are kept elsewhere")
        return self.blocked.transpose(1, 2).reshape(self.shape)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight in fp32 (an embedding lookup), from whichever copy is held."""
        return self.held[ids].float() if self.held is not None else self.blocked[ids // BLOCK, :, ids % BLOCK]

    def drop_dense(self) -> bool:
        """Let go of the dense fp32 copy where the blocked bytes can stand in for it; whether none is held now."""
        if self.blocked is not None:
            self.held = None
        return self.held is None or self.half

    @property
    def nbytes(self) -> int:
        """Bytes one product reads."""
        return self.shape.numel() * (2 if self.half else 4)


BLOCK = 64  # output rows per block of the packed layout the decode gemv reads (cpu_decode.cpp's BLOCK)


def blocked_view(packed: torch.Tensor, dense: torch.Tensor | None) -> torch.Tensor | None:
    """oneDNN's bytes of `packed` as a [N / 64, K, 64] fp32 tensor (no copy; valid while `packed` lives) when they
    hold exactly `dense` in that layout, else None."""
    if dense is None or dense.dtype != torch.float32 or dense.dim() != 2 or dense.shape[0] % BLOCK or dense.shape[1] % 4:
        return None
    n, k = dense.shape
    try:
        if torch.ops.mkldnn._nbytes(packed) != n * k * 4:
            return None
        raw = (ctypes.c_float * (n * k)).from_address(torch.ops.mkldnn.data_ptr(packed))
    except (RuntimeError, AttributeError):
        return None
    view = torch.frombuffer(raw, dtype=torch.float32).view(n // BLOCK, k, BLOCK)
    return view if torch.equal(view, dense.view(n // BLOCK, BLOCK, k).transpose(1, 2)) else None


@functools.cache
def _op_works(dtype: torch.dtype = torch.float32) -> str | None:
    """None when this torch build's oneDNN linear runs in `dtype` and agrees with F.linear, else why not."""
    if not torch.backends.mkldnn.is_available():
        return f"torch {torch.__version__} was built without oneDNN"
    try:
        gen = torch.Generator().manual_seed(0)
        w, x = torch.randn(48, 32, generator=gen).to(dtype), torch.randn(3, 32, generator=gen).to(dtype)
        y = torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(w, HINT_ROWS), None,
                                               "none", [], "")
    except (RuntimeError, AttributeError) as exc:
        return f"oneDNN {str(dtype).replace('torch.', '')} linear is unavailable here: {str(exc).splitlines()[0]}"
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    if not torch.allclose(y.float(), F.linear(x.float(), w.float()), atol=tol * 10, rtol=tol):
        return f"oneDNN {str(dtype).replace('torch.', '')} linear disagrees with F.linear on this machine"
    return None


def unsupported(weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> str | None:
    """None when `weight` can be packed here in `dtype`, else why not; ValueError for a malformed KVTOOL_CPU_GEMM."""
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
    return _op_works(dtype)


def pack(weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> PackedWeight:
    """`weight` (fp32) packed for oneDNN in `dtype` (fp32, or bf16: a rounded copy)."""
    reason = unsupported(weight, dtype)
    if reason:
        raise ValueError(reason)
    dense = weight.detach().to(dtype).contiguous()
    return PackedWeight(dense, torch.ops.mkldnn._reorder_linear_weight(dense, HINT_ROWS))


def packed_linear(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None,
                  residual: torch.Tensor | None = None, exact_rows: int = 0, half_out: bool = False) -> torch.Tensor:
    """x [..., K] @ W.T + bias (+ residual) through oneDNN (a bf16 weight: x, fp32 or already bf16, and the product
    rounded to bf16, bias and residual added in fp32, or with `half_out` and neither the bf16 product itself; with
    `exact_rows`, up to that many fp32 rows through the C++ ops' gemv once they are loaded: sums over the weight
    widened exactly); other dtypes, and inputs that need gradients, take the reference."""
    takes = (torch.float32, torch.bfloat16) if w.half else (torch.float32,)
    if x.dtype not in takes or (x.requires_grad and torch.is_grad_enabled()) or x.shape[-1] != w.shape[1]:
        y = F.linear(x, w.dense.to(x.dtype), bias)
    elif not w.half and residual is not None:  # one oneDNN call: the residual as a binary post-op
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, w.packed, bias, "add")
    elif not w.half:
        return torch.ops.mkldnn._linear_pointwise(x, w.packed, bias, "none", [], "")
    elif x.dtype == torch.float32 and cpu_decode.loaded() and x.numel() <= exact_rows * x.shape[-1]:
        y = torch.ops.kvtool_cpu.gemv(x.reshape(-1, x.shape[-1]).contiguous(), w.held, bias, None)
        y = y.reshape(*x.shape[:-1], w.shape[0])
    else:
        y = torch.ops.mkldnn._linear_pointwise(x.bfloat16(), w.packed, None, "none", [], "")
        if half_out and bias is None and residual is None:
            return y
        y = y if bias is None else bias + y  # fp32 + bf16 promotes: y is widened inside the add, not copied first
        y = y if residual is not None else y.float()
    return y if residual is None else residual + y


def packed_linear_reference(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The same product through F.linear over the dense values (fp32)."""
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


class PackedEmbedding(nn.Module):
    """A plain nn.Embedding whose table is also the packed output head (tied weights): the rows come from the
    head's PackedWeight, so the table is held once."""

    def __init__(self, table: PackedWeight):
        super().__init__()
        self.table = table
        self.num_embeddings, self.embedding_dim = table.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table.rows(ids)
