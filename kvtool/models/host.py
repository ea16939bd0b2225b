"""Host-memory tuning for CPU inference: keep freed buffers in the process instead of handing them back.

A prefill allocates tens of MB per layer (the fused gate/up output alone is T x 2I floats) and frees
it a moment later. glibc serves blocks above its mmap threshold (128 KiB, rising to at most 32 MiB)
with fresh mmaps and trims the heap top when enough is free, so the next layer or request touches new
pages again: about 1.3 GB of page faults (a second of system time) per 2,048-token prefill of
SmolLM2 when another model shares the process. Raising both thresholds keeps that memory reusable,
as jemalloc or tcmalloc would. The cost is resident memory that stays at its peak.
Set KVTOOL_HEAP_TUNING=0 to leave the allocator alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc <malloc.h>
THRESHOLD = 1 << 30

_tuned: bool | None = None


def tune_host_allocator() -> bool:
    """Raise glibc's mmap and trim thresholds once per process; True when they are in effect."""
    global _tuned
    if _tuned is not None:
        return _tuned
    _tuned = False
    if os.environ.get("KVTOOL_HEAP_TUNING", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and other libcs have no mallopt
        return False
    _tuned = bool(mallopt(M_MMAP_THRESHOLD, THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, THRESHOLD))
    return _tuned


def release_openmp_threads() -> bool:
    """Hand back the OpenMP worker threads the calling thread started; True when the runtime did.

    GNU OpenMP (torch's CPU threads on Linux) keeps one team of workers per thread that ever ran a
    parallel region. Once it manages more threads than there are cores, every team stops spin-waiting
    between regions and sleeps instead, so each op of a decode step pays a wake-up. A server loads the
    model on its main thread (one team) and runs it on a worker thread (a second team): on 2 cores that
    made SmolLM2's packed matmuls ~45% slower and an elementwise op 3x slower than on the thread that
    loaded. Call this on the loading thread before another thread takes the model over; the team comes
    back by itself if this thread runs parallel work again.
    """
    import torch

    lib = os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp.so.1")
    try:
        gomp = ctypes.CDLL(lib if os.path.exists(lib) else (ctypes.util.find_library("gomp") or "libgomp.so.1"))
        pause = gomp.omp_pause_resource_all
    except (OSError, AttributeError):  # not GNU OpenMP (macOS, Windows), or too old to pause
        return False
    return pause(1) == 0  # omp_pause_soft
