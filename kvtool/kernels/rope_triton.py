"""Triton RoPE re-rotation for CUDA: one launch rotates a whole [L, H, T, D] block, in place or not.

The op is memory-bound (read D values, write D values per row), so each program streams a tile
of BLOCK_R rows; cos/sin of the one shared delta are [D/2] vectors that stay in cache.
Import this module only where triton is installed (kvtool.kernels does it lazily).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvtool.kernels.rope_ref import rotation_cos_sin


@triton.jit
def _rerotate_kernel(src, dst, cos_ptr, sin_ptr, n_rows, HALF: tl.constexpr, BLOCK_R: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, HALF)
    mask = rows[:, None] < n_rows
    first = rows[:, None] * (2 * HALF) + cols[None, :]  # offsets of x[..., :HALF]
    x1 = tl.load(src + first, mask=mask).to(tl.float32)
    x2 = tl.load(src + first + HALF, mask=mask).to(tl.float32)
    c = tl.load(cos_ptr + cols)[None, :]
    s = tl.load(sin_ptr + cols)[None, :]
    tl.store(dst + first, (x1 * c - x2 * s).to(dst.dtype.element_ty), mask=mask)
    tl.store(dst + first + HALF, (x2 * c + x1 * s).to(dst.dtype.element_ty), mask=mask)


def supports(keys: torch.Tensor) -> bool:
    """The kernel handles contiguous tensors whose half head_dim is a power of two."""
    half = keys.shape[-1] // 2
    return keys.is_contiguous() and keys.shape[-1] % 2 == 0 and half >= 1 and (half & (half - 1)) == 0


def rerotate_triton(keys: torch.Tensor, delta: int, inv_freq: torch.Tensor,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as rerotate_reference; keys and out must be contiguous."""
    if not supports(keys):
        raise ValueError(f"triton rerotate needs a contiguous tensor with a power-of-two half head_dim; "
                         f"got shape {tuple(keys.shape)}, contiguous={keys.is_contiguous()}")
    out = torch.empty_like(keys) if out is None else out
    if not out.is_contiguous() or out.shape != keys.shape:
        raise ValueError("triton rerotate: out must be a contiguous tensor shaped like keys")
    half = keys.shape[-1] // 2
    n_rows = keys.numel() // keys.shape[-1]
    if n_rows == 0:
        return out
    cos, sin = rotation_cos_sin(delta, inv_freq, keys.device)
    block_r = max(1, 4096 // half)  # ~16 KB of bf16 per tile and half
    grid = (triton.cdiv(n_rows, block_r),)
    _rerotate_kernel[grid](keys, out, cos, sin, n_rows, HALF=half, BLOCK_R=block_r, num_warps=4)
    return out
