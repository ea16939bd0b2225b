"""The memory row of `kvtool bench peers`: the resident memory of an engine server's whole process tree (the
server and every process it started, from /proc), read after one request, beside the KV and prefix-cache
budgets the engine was started with. RSS counts a page shared by two processes of the tree (a forked child's
libraries) in both; PSS splits it between them, so the tree's PSS is what it holds on its own."""

from __future__ import annotations

from pathlib import Path

from kvtool.serving.server_process import children


def _field_kib(path: str, field: str) -> int:
    """A `Name:  N kB` line of a /proc file, in KiB (0 for a process that is gone or a kernel thread)."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() or "?"
    except OSError:
        return "?"


def tree_rss(pid: int) -> dict:
    """The resident memory of pid and its descendants: {rss_mib, pss_mib, processes, by_name: {name: rss_mib}}
    (name: the process's /proc comm, e.g. VLLM::EngineCor; processes of one name summed)."""
    pids = [pid, *children(pid)]
    sizes = {p: _field_kib(f"/proc/{p}/status", "VmRSS") for p in pids}
    names: dict[str, int] = {}
    for p, kib in sizes.items():
        if kib:
            names[_name(p)] = names.get(_name(p), 0) + kib
    pss = sum(_field_kib(f"/proc/{p}/smaps_rollup", "Pss") for p in pids)
    return {"rss_mib": round(sum(sizes.values()) / 1024.0, 1), "pss_mib": round(pss / 1024.0, 1),
            "processes": sum(s > 0 for s in sizes.values()),
            "by_name": {n: round(k / 1024.0, 1) for n, k in names.items()}}
