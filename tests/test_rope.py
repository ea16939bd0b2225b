"""RoPE tables (kvtool.models.rope.cos_sin): the same bits whatever thread computes them."""

import torch

from kvtool.models.rope import cos_sin, inv_frequencies


def test_cos_sin_are_the_fp64_values_of_the_fp32_angles_rounded_at_any_thread_count():
    """torch's fp32 cos of a tensor split over threads was off by up to 1.5e-4 where a second thread computed it, in
    some processes: a prefill's keys then depended on the process. The tables are fp64 values rounded to fp32."""
    inv_freq, _ = inv_frequencies({"rope_theta": 10000.0}, 64)
    positions = torch.arange(8192)
    angles = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), -1).double()
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            cos, sin = cos_sin(inv_freq, positions, 0.5, torch.float32)
            assert torch.equal(cos, (angles.cos() * 0.5).float()) and torch.equal(sin, (angles.sin() * 0.5).float())
    finally:
        torch.set_num_threads(threads)
