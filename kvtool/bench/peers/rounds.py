"""How `kvtool bench peers` repeats its engines and judges the machine it ran on (pure Python, no torch):

- every engine runs once per round, the rounds in alternating order (A B C D D C B A A B ...), so a drift of
  the machine hits every engine alike;
- each figure of the record is the median over the rounds, its spread the min and max of the rounds;
- a run is quiet when the 1-minute load average stayed at or below the core count the whole time; beside it the
  record gives the CPU time that processes outside the run took (others_cpu_max), since a server's own bursts
  of runnable threads also lift the load average;
- each sample is tagged with what the run was doing (an engine's start-up, a workload, its stop), so a
  record shows where its highest load fell, and each engine starts only once the load left by the one before
  has settled (settle), so one engine's start-up or client does not count against the next.
"""

from __future__ import annotations

import os
import statistics
import threading
import time

_PHASE = ["idle"]  # what the run is doing now; LoadMonitor tags each sample with it


def set_phase(name: str) -> None:
    """Name what the run does from now on (an engine's "start-up", a workload's name) for the load samples."""
    _PHASE[0] = name


def settle(cores: int, max_wait_s: float = 180.0, every_s: float = 5.0, log=None, _load=None, _sleep=time.sleep) -> dict:
    """Wait until the 1-minute load average is at most half the core count (what the engine before left behind
    decays), or max_wait_s passed. Returns {"waited_s", "load"}: how long it waited and the load it started at."""
    load_now = _load or (lambda: os.getloadavg()[0])
    target, waited = cores / 2, 0.0
    while load_now() > target and waited < max_wait_s:
        _sleep(every_s)
        waited += every_s
    level = round(load_now(), 2)
    if log and waited:
        log(f"  waited {waited:.0f} s for the load to settle: {level} (target <= {target:g})")
    return {"waited_s": waited, "load": level}


def alternating_order(engines: list[str], rounds: int) -> list[tuple[int, str]]:
    """(round, engine) in run order: the engines forward in odd rounds, backward in even ones."""
    order = []
    for r in range(rounds):
        names = engines if r % 2 == 0 else engines[::-1]
        order += [(r + 1, name) for name in names]
    return order


def _summary(values: list[float]) -> dict:
    """The shape kvtool.bench.protocol.summary gives: median, min, max, stdev, n and the values (runs)."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "stdev": statistics.stdev(values) if len(values) > 1 else 0.0, "n": len(values), "runs": list(values)}


def _is_summary(value) -> bool:
    return isinstance(value, dict) and "median" in value and "runs" in value


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def combine(rounds: list[dict]) -> tuple[dict, dict]:
    """One engine's results of several rounds as one: every figure the median over the rounds.

    A summary ({median, min, max, runs}) becomes the summary of the rounds' medians (its runs: one value per
    round); a plain number becomes the rounds' median (an int stays an observed value: the lower median).
    Other values (names, lists) are the first round's. Returns (results, spread), spread mapping each figure's
    dotted path to {min, max, n} over the rounds.
    """
    spread: dict[str, dict] = {}

    def note(path: str, values: list) -> None:
        spread[path] = {"min": min(values), "max": max(values), "n": len(values)}

    def merge(values: list, path: str):
        if _is_summary(values[0]):
            medians = [v["median"] for v in values if _is_summary(v) and v["median"] is not None]
            if not medians:
                return values[0]
            note(path, medians)
            return _summary(medians)
        if isinstance(values[0], dict):
            keys = dict.fromkeys(k for v in values if isinstance(v, dict) for k in v)
            return {k: merge([v[k] for v in values if isinstance(v, dict) and k in v], f"{path}.{k}" if path else k)
                    for k in keys}
        numbers = [v for v in values if _is_number(v)]
        if not numbers:
            return values[0]
        note(path, numbers)
        if all(isinstance(v, int) for v in numbers):
            return statistics.median_low(numbers)
        return statistics.median(numbers)

    results = [r for r in rounds if r]
    return (merge(results, "") if results else {}), spread


def is_quiet(loads: list[float], cores: int) -> bool:
    """True when every sampled 1-minute load average is at most the core count (and there is a sample)."""
    return bool(loads) and max(loads) <= cores


def cpu_split() -> tuple[float, float, float] | None:
    """(now, CPU seconds the whole machine was busy, CPU seconds of this process and its descendants, the exited
    ones it waited for included) from /proc; None where there is none (not Linux)."""
    try:
        with open("/proc/stat") as fh:
            user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fh.readline().split()[1:9])
        own, children, pid = 0, {}, os.getpid()
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                try:
                    with open(f"/proc/{entry.name}/stat") as fh:
                        fields = fh.read().rsplit(")", 1)[1].split()  # the fields after "pid (comm)"
                except OSError:
                    continue  # it exited meanwhile
                children.setdefault(int(fields[1]), []).append((int(entry.name), sum(map(int, fields[11:15]))))
                if int(entry.name) == pid:
                    own += sum(map(int, fields[11:15]))  # utime, stime, cutime, cstime
    except (OSError, ValueError, IndexError):
        return None
    todo = [pid]
    while todo:  # the descendants: their own times, and those of the children they waited for
        for child, ticks in children.get(todo.pop(), []):
            own += ticks
            todo.append(child)
    tick = os.sysconf("SC_CLK_TCK")
    return time.monotonic(), (user + nice + system + irq + softirq + steal) / tick, own / tick


class LoadMonitor:
    """Samples os.getloadavg()[0] every ``every_s`` seconds in a daemon thread while the block runs:
    ``with LoadMonitor() as m: ...`` then m.samples (first taken on entry, last on exit), m.phases, the phase
    (set_phase) each sample was taken in, and m.others: from the second sample on, the cores that processes
    outside this one and its children kept busy since the sample before (where /proc tells)."""

    def __init__(self, every_s: float = 5.0):
        self.every_s, self.samples, self.phases, self.others = every_s, [], [], []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._split = None

    def _sample(self) -> None:
        self.samples.append(round(os.getloadavg()[0], 2))
        self.phases.append(_PHASE[0])
        split, before = cpu_split(), self._split
        if split is not None and before is not None and split[0] > before[0]:
            busy, own = split[1] - before[1], split[2] - before[2]
            self.others.append(round(max(0.0, busy - own) / (split[0] - before[0]), 2))
        self._split = split

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self._sample()

    def __enter__(self) -> "LoadMonitor":
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


def load_summary(samples: list[float], cores: int | None = None, phases: list[str] | None = None,
                 others: list[float] | None = None) -> dict:
    """The machine's load over a whole run: cores, the first, last, lowest and highest sample, quiet or not,
    (given each sample's phase) the highest sample in each phase, and (given LoadMonitor.others) the most cores
    that processes outside the run kept busy between two samples."""
    cores = cores or os.cpu_count() or 1
    out = {"cores": cores, "first": samples[0] if samples else None, "last": samples[-1] if samples else None,
           "min": min(samples, default=None), "max": max(samples, default=None), "samples": len(samples),
           "quiet": is_quiet(samples, cores)}
    if phases:
        by_phase: dict[str, float] = {}
        for value, phase in zip(samples, phases):
            by_phase[phase] = max(value, by_phase.get(phase, value))
        out["max_by_phase"] = by_phase
    if others:
        out["others_cpu_max"] = max(others)
    return out


def figure(row: dict, path: str) -> tuple[float, float, float] | None:
    """(median, min, max) over the rounds of one figure of an engine's entry, by its dotted path in the results
    ("decode_tok_s", "memory.rss_mib"); min and max equal the median where the record has no spread for it."""
    value = row.get("results") or {}
    for key in path.split("."):
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    if _is_summary(value):
        return value["median"], value["min"], value["max"]
    if not _is_number(value):
        return None
    spread = (row.get("spread") or {}).get(path) or {}
    return value, spread.get("min", value), spread.get("max", value)
