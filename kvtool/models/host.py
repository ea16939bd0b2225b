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


def trim_heap() -> bool:
    """Hand the heap's free pages back to the system (malloc_trim), once loading dropped copies it no longer needs;
    True where glibc did."""
    try:
        return bool(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):  # musl and other libcs
        return False


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


MADV_PAGEOUT, PAGE = 21, 4096  # Linux 5.4+: reclaim these pages now (clean file pages are read again on use)


def page_out_files(paths, keep=()) -> int:
    """Hand back the pages of this process's mappings of `paths` (MADV_PAGEOUT) that no tensor in `keep` lies
    on; the bytes advised. Pages of tensors that loading copied and dropped (q, k, v before fuse()) stayed
    resident (0.9 GB of Qwen2.5's 5.1 GB); they are clean, so the kernel drops them and no tensor changes. 0
    where Linux or madvise does not (or KVTOOL_HEAP_TUNING=0)."""
    if os.environ.get("KVTOOL_HEAP_TUNING", "1") == "0" or not sys.platform.startswith("linux"):
        return 0
    import torch

    names, ranges = {os.path.realpath(p) for p in paths}, []
    try:
        with open("/proc/self/maps") as fh:  # "lo-hi perms offset dev inode path"
            for fields in (line.split(None, 5) for line in fh):
                if len(fields) == 6 and fields[5].strip() in names:
                    ranges.append([int(x, 16) for x in fields[0].split("-")])
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return 0
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    kept = sorted(_extent(t) for t in keep if t.layout == torch.strided and t.device.type == "cpu" and t.numel())
    advised = 0
    for lo, hi in ranges:
        for start, end in [*kept, (hi, hi)]:  # each part of [lo, hi) before the next kept extent
            if min(start, hi) > lo and libc.madvise(lo, min(start, hi) - lo, MADV_PAGEOUT) == 0:
                advised += min(start, hi) - lo
            lo = max(lo, end)
    return advised


def _extent(t) -> tuple[int, int]:
    """The whole pages a tensor's elements lie on: [first, past the last) page addresses."""
    start = t.data_ptr()
    end = start + (1 + sum((n - 1) * step for n, step in zip(t.shape, t.stride()))) * t.element_size()
    return start // PAGE * PAGE, -(-end // PAGE) * PAGE
