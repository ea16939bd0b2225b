"""Rotary position embeddings (HF "rotate_half" convention).

Keys are cached post-RoPE; relocating a key from position p to p+d multiplies it by
R(d) because RoPE rotations compose: R(p+d) = R(d) R(p).
"""

from __future__ import annotations

from typing import Any

import torch


def inv_frequencies(rope: dict[str, Any], head_dim: int, config: Any = None) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim/2] fp32, attention scaling) for the config's rope type."""
    kind = rope.get("rope_type", "default")
    if kind in ("default", "linear"):  # linear: positions divided by `factor` (Gemma 3's global layers)
        base, factor = float(rope["rope_theta"]), float(rope.get("factor", 1.0)) if kind == "linear" else 1.0
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)) / factor, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if config is None:
        raise ValueError(f"rope_type {rope['rope_type']!r} needs the HF config")
    return ROPE_INIT_FUNCTIONS[rope["rope_type"]](config)


def cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, scaling: float, dtype: torch.dtype):
    """cos, sin [T, head_dim] for integer positions [T]: fp32 angles, their cos and sin in fp64 (MPS: fp32) rounded
    to `dtype`, the same bits whichever CPU thread computes them (torch's fp32 cos of a tensor split over threads
    is not: tests/test_rope.py)."""
    freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    emb = emb if emb.device.type == "mps" else emb.double()
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, head_dim] rotated by cos/sin [T, head_dim]."""
    return x * cos + rotate_half(x) * sin
