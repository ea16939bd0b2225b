"""Which torch ops a call dispatches: how tests tell which kernel ran."""

from __future__ import annotations

from torch.profiler import ProfilerActivity, profile


def ops_of(fn) -> set[str]:
    """The names of the ops fn() dispatched (e.g. "kvtool_cpu::gemv", "aten::addmm")."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {event.key for event in prof.key_averages()}
