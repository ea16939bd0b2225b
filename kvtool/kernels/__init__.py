"""Kernels with a pure-torch fp32 reference beside each fast path.

`rerotate(keys, delta, inv_freq)` moves post-RoPE keys [..., T, D] by `delta` positions.
On CUDA with triton installed it runs the Triton kernel (one launch for a whole [L, H, T, D]
block); on CPU and MPS, and for layouts the kernel does not take, the reference.
"""

from __future__ import annotations

import functools

import torch

from kvtool.kernels.rope_ref import rerotate_reference, rotation_cos_sin

BACKENDS = ("auto", "reference", "triton")


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def pick_backend(keys: torch.Tensor, backend: str = "auto") -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown rerotate backend {backend!r}; use one of {', '.join(BACKENDS)}")
    if backend == "reference":
        return backend
    usable = keys.device.type == "cuda" and triton_available()
    if usable:
        from kvtool.kernels.rope_triton import supports

        usable = supports(keys)
    if backend == "triton" and not usable:
        raise ValueError(f"the triton backend needs a contiguous CUDA tensor with a power-of-two half head_dim "
                         f"and triton installed; got {keys.device.type} {tuple(keys.shape)}, "
                         f"triton {'installed' if triton_available() else 'missing'}")
    return "triton" if usable else "reference"


def rerotate(keys: torch.Tensor, delta: int, inv_freq: torch.Tensor, out: torch.Tensor | None = None,
             backend: str = "auto") -> torch.Tensor:
    """keys [..., T, D] rotated by `delta` positions into `out` (new tensor by default)."""
    if pick_backend(keys, backend) == "triton":
        from kvtool.kernels.rope_triton import rerotate_triton

        return rerotate_triton(keys, delta, inv_freq, out=out)
    return rerotate_reference(keys, delta, inv_freq, out=out)


def rerotate_(keys: torch.Tensor, delta: int, inv_freq: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """In-place rerotate; returns keys."""
    return rerotate(keys, delta, inv_freq, out=keys, backend=backend)


__all__ = ["BACKENDS", "pick_backend", "rerotate", "rerotate_", "rerotate_reference", "rotation_cos_sin",
           "triton_available"]
