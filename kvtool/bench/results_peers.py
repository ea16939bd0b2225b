"""The `kvtool bench peers` tables of the results index: every record's full table (benchmarks/results/README.md)
and the current figures of the latest quiet record per model, workload and set of engines (each the median of the
record's rounds with their min-max, and the command that reproduces it), whose ratios the project README shows.

A record is quiet only when it says so (``"quiet": true``: its load, sampled throughout, never passed the core
count); a record without the field was made before the load was sampled throughout, and counts as noisy.
"""

from __future__ import annotations

from pathlib import Path

from kvtool.bench.peers.config import ENGINE_NAMES
from kvtool.bench.peers.judge import CLIENT_ROWS, client_load
from kvtool.bench.peers.report import client_load_text, equal_table, threads_text
from kvtool.bench.peers.roofline import roofline_rows, summary
from kvtool.bench.peers.rounds import figure
from kvtool.bench.peers.vllm_client import result_key

# the columns of every table; an engine outside them (kvtool-vllm) gets a column only where a record ran it
PEER_COLUMNS = ("kvtool", "kvtool-int4", "kvtool-bf16", "llama.cpp", "vllm", "vllm-bf16", "transformers")
VLLM_BENCH_ROWS = (("output_throughput", "output tok/s"), ("median_ttft_ms", "TTFT median (ms)"),
                   ("p90_ttft_ms", "TTFT p90 (ms)"), ("p99_ttft_ms", "TTFT p99 (ms)"),
                   ("median_tpot_ms", "TPOT median (ms)"), ("p99_tpot_ms", "TPOT p99 (ms)"))
JUDGED_ROWS = ("output_throughput", "median_ttft_ms", "p90_ttft_ms", "median_tpot_ms")  # the README's: what targets judge


def is_quiet(record: dict) -> bool:
    return record.get("quiet") is True


def _n(v) -> str:
    if v is None:
        return "n/a"
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}"


def spread(row: dict, path: str) -> str:
    """median (min-max) of one figure; the median alone where every round gave the same value."""
    f = figure(row, path)
    if f is None:
        raise KeyError(path)
    lo, hi = _n(f[1]), _n(f[2])
    return _n(f[0]) + (f" ({lo}-{hi})" if lo != hi else "")


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs)


def workload_rows(record: dict, judged: bool = False) -> list[tuple[str, str, object]]:
    """(workload, label, engine entry -> cell) for every figure the record's workloads produce (`bench serve`'s judged
    four where ``judged``); each stream count is a workload of its own, so a record of other counts hides none."""
    c = record["config"]
    rows = [("memory", "RSS after one request (MiB)", lambda e: spread(e, "memory.rss_mib")),
            ("decode", f"decode bs=1, {c['decode_tokens']} tokens (tok/s)", lambda e: spread(e, "decode_tok_s"))]
    rows += [("ttft", f"cold TTFT @{n} (ms)", lambda e, n=n: spread(e, f"ttft_ms_{n}")) for n in c["ttft_lengths"]]
    rows.append(("prefix", f"prefix hit {c['prefix_tokens']}+{c['suffix_tokens']} (ms; cached tokens)",
                 lambda e: f"{spread(e, 'prefix_hit_ms')}; {e['results']['prefix_cached_tokens']}"))
    rows += [(f"streams {n}", f"{n} streams x {c['stream_tokens']} (tok/s)",
              lambda e, n=n: spread(e, f"streams_{n}.tok_s")) for n in c["streams"]]
    rows.append(("layouts", "context layouts: mean cached after 1st",
                 lambda e: f"{100 * _mean([x['hit_rate_after_first'] for x in e['results']['layouts'].values()]):.0f}%"))
    for w in CLIENT_ROWS:
        if client_load(c, w) and w in c.get("workloads", []):
            rows += [(w, f"{w} (vLLM bench serve), {client_load_text(c, w)}: {label}",
                      lambda e, key=key, w=w: spread(e, f"{result_key(w)}.{key}")) for key, label in VLLM_BENCH_ROWS
                     if key in JUDGED_ROWS or not judged]
    return [r for r in rows if r[0].split()[0] in c.get("workloads", [])]


def columns(records: list[dict]) -> list[str]:
    """PEER_COLUMNS, and every other engine one of the records ran, in the order of ENGINE_NAMES."""
    ran = {n for rec in records for n in rec["engines"]}
    return [n for n in ENGINE_NAMES if n in PEER_COLUMNS or n in ran]


def cells(record: dict, get, names: list[str] | None = None) -> list[str]:
    engines, out = record["engines"], []
    for name in names or columns([record]):
        e = engines.get(name)
        if e is None:
            out.append("not run")
        elif e["status"] != "ok":
            out.append(e["status"])
        else:
            try:
                out.append(get(e))
            except (KeyError, TypeError, ZeroDivisionError):
                out.append("n/a")
    return out


def _has_figures(row: list[str]) -> bool:
    return any(c not in ("n/a", "not run", "missing", "failed") for c in row)


def load_text(record: dict) -> str:
    """The machine's load while the record was made: sampled throughout (newer records) or per engine."""
    load = record.get("load")
    if load:
        return f"load {_n(load['min'])}-{_n(load['max'])} on {load['cores']} cores"
    loads = [x for e in record["engines"].values() for x in e.get("load_avg", [])]
    return f"load {_n(min(loads))}-{_n(max(loads))} at each engine's start and end" if loads else "load not recorded"


def peer_table(path: Path, record: dict, link: str) -> list[str]:
    """The full table of one record for benchmarks/results/README.md, quiet or noisy said first."""
    engines = record["engines"]
    head = ["workload", *[f"{n} ({engines[n].get('weights', '')})" if n in engines else n for n in columns([record])]]
    rows = [[label, *cells(record, get)] for _, label, get in workload_rows(record)]
    rows = [r for r in rows if _has_figures(r[1:])]
    load = ["/".join(f"{x:.1f}" for x in engines[n].get("load_avg", [])) or "-" if n in engines else "-"
            for n in columns([record])]
    rounds = record["config"].get("rounds", 1)
    quiet = "quiet" if is_quiet(record) else "noisy (not in the project README)"
    lines = [f"{record['model']} on {record['device']}, {record['date'][:10]} ([{path.name}]({link})): {quiet}, "
             f"{load_text(record)}; median (min-max) of {rounds} round{'s' if rounds > 1 else ''}"
             f"{'' if rounds > 1 else ' (min-max over its repeats)'}.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in rows + [["load average (min/max)", *load]]]
    lines += ["", "Targets: " + "; ".join(f"{t['target']}: {_x(t['ratio'])} ({t['status']})"
                                          for t in record.get("targets", []))]
    return lines + (["", f"Roofline: {summary(record)}."] if roofline_rows(record) is not None else [])


def _x(v) -> str:
    return "n/a" if v is None else f"{v:.2f}x"


def _ran(record: dict) -> dict[str, frozenset]:  # per workload of the record, the engines with a figure of it
    names, ran = columns([record]), {}
    for wl, _, get in workload_rows(record):
        row = cells(record, get, names)
        ran[wl] = ran.get(wl, frozenset()) | {n for n, cell in zip(names, row) if _has_figures([cell])}
    return ran


def _current(peers: list[tuple[Path, dict]]) -> list[tuple[str, str, Path, dict]]:
    """(model and threads, workload, path, record): per model and workload, the latest quiet record of each set of
    engines (hidden by a later one that ran them all), in the table's order."""
    latest: dict[tuple[str, str], list[tuple[Path, dict, frozenset]]] = {}
    for path, rec in sorted(((p, r) for p, r in peers if is_quiet(r)), key=lambda pr: pr[1]["date"]):
        for workload, ran in _ran(rec).items():
            key = (f"{rec['model']}, {threads_text(rec)}", workload)
            if ran:
                latest[key] = [old for old in latest.get(key, []) if not old[2] <= ran] + [(path, rec, ran)]
    return [(model, w, path, rec) for model in sorted({m for m, _ in latest}) for m, w in latest if m == model
            for path, rec, _ in latest[(m, w)]]


def _none_quiet(peers: list) -> list[str]:
    return ["(no quiet `kvtool bench peers` record yet: " + (f"the {len(peers)} recorded here are noisy, their load "
            "passed the core count or was not sampled throughout, so they stay in benchmarks/results/ only)"
            if peers else "none recorded)")]


def _roofline_record(peers: list) -> list[tuple[Path, dict]]:  # the newest measured against the machine, quiet or not
    return sorted(((p, r) for p, r in peers if roofline_rows(r)), key=lambda pr: pr[1]["date"])[-1:]


def quiet_block(peers: list[tuple[Path, dict]], readme: Path) -> list[str]:
    """The current figures (_current), linked from `readme`'s folder, and the commands of their records."""
    current = _current(peers)
    if not current:
        return _none_quiet(peers)
    names = columns([rec for *_, rec in current])
    lines = ["| model | workload | " + " | ".join(names) + " | record |", "|" + "---|" * (len(names) + 3)]
    used, shown = {}, set()
    for model, workload, path, rec in current:
        used[path] = rec
        link = str(path.relative_to(readme.parent))
        for wl, label, get in workload_rows(rec, judged=True):
            row = cells(rec, get, names)
            if wl == workload and _has_figures(row):
                lines.append(f"| {model if model not in shown else ''} | {label} | " + " | ".join(row) +
                             f" | [{path.parent.name}]({link}) |")
                shown.add(model)
    lines += ["", "Each cell is the median of the record's rounds (every engine run at least twice, in alternating "
                  "order), min-max in brackets.", "", "Reproduce a record with its command:", ""]
    for path, rec in {**used, **dict(_roofline_record(peers))}.items():
        lines.append(f"- {path.parent.name} ({rec['date'][:10]}, {load_text(rec)}): `{rec['command']}`")
    return lines


def ratio_block(peers: list[tuple[Path, dict]]) -> list[str]:
    """The project README's part: the current records' ratios at equal precision, and the newest roofline line."""
    current = _current(peers)
    if not current:
        return _none_quiet(peers)
    lines = []
    for path, rec in {path: rec for _, _, path, rec in current}.items():
        head, rows = equal_table(rec)
        if rows:
            lines += ["", f"{path.parent.name} ({rec['model']}, {threads_text(rec)}):", "",
                      "| " + " | ".join(head) + " |", "|" + "---|" * len(head), *["| " + " | ".join(r) + " |" for r in rows]]
    for path, rec in _roofline_record(peers):
        lines += ["", f"Roofline of {path.parent.name} ({rec['model']}, {threads_text(rec)}, "
                      f"{'quiet' if is_quiet(rec) else 'noisy'}, {load_text(rec)}; docs/benchmarks.md, \"Roofline\"): "
                      f"{summary(rec)}."]
    return lines[1:]
