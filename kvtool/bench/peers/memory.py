"""The memory row of `kvtool bench peers`: the resident memory of an engine server's whole process tree (the
server and every process it started, from /proc), read after one request, beside the KV and prefix-cache
budgets the engine was started with."""

from __future__ import annotations

from pathlib import Path

from kvtool.serving.server_process import children


def rss_kib(pid: int) -> int:
    """VmRSS of one process in KiB (0 for a process that is gone or a kernel thread)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def tree_rss(pid: int) -> dict:
    """The resident memory of pid and its descendants: {rss_mib, processes}."""
    pids = [pid, *children(pid)]
    sizes = [rss_kib(p) for p in pids]
    return {"rss_mib": round(sum(sizes) / 1024.0, 1), "processes": sum(s > 0 for s in sizes)}
