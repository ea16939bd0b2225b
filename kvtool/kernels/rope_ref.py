"""Reference RoPE re-rotation (pure torch, fp32 math): the slow path every fast kernel is tested against.

Keys are cached post-RoPE, so moving a key from position p to p + delta multiplies it by
R(delta) (rotations compose: R(p + delta) = R(delta) R(p)). R(delta) uses the model's inv_freq
but never its attention scaling: that factor is already inside the cached key.
"""

from __future__ import annotations

import torch


def rotation_cos_sin(delta: int, inv_freq: torch.Tensor, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [head_dim/2] fp32 of the angle delta * inv_freq, computed in fp64.

    fp64 keeps the angle exact to ~1e-12 rad even for deltas of 1e5 positions; the fp32
    product would be off by up to delta * 6e-8 rad. Computed where inv_freq lives (no host
    sync on CUDA); MPS has no fp64, so there it goes through the CPU.
    """
    device = torch.device(device) if device is not None else inv_freq.device
    freq = inv_freq.detach()
    if freq.device.type == "mps":
        freq = freq.cpu()
    angle = freq.to(torch.float64) * float(delta)
    return angle.cos().float().to(device), angle.sin().float().to(device)


def rerotate_reference(keys: torch.Tensor, delta: int, inv_freq: torch.Tensor,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """keys [..., T, head_dim] (any leading dims, e.g. [L, H, T, D]) rotated by `delta` positions.

    Computes in fp32 and writes `out` (a new tensor by default; pass out=keys for in place).
    """
    half = keys.shape[-1] // 2
    if inv_freq.shape[-1] != half:
        raise ValueError(f"inv_freq has {inv_freq.shape[-1]} frequencies; keys with head_dim "
                         f"{keys.shape[-1]} need {half}")
    cos, sin = rotation_cos_sin(delta, inv_freq, keys.device)
    x = keys.float()
    x1, x2 = x[..., :half], x[..., half:]
    first = torch.addcmul(x1 * cos, x2, sin, value=-1.0)  # x1 cos - x2 sin
    second = torch.addcmul(x2 * cos, x1, sin)  # x2 cos + x1 sin
    out = torch.empty_like(keys) if out is None else out
    out[..., :half] = first
    out[..., half:] = second
    return out
