"""Regenerate benchmarks/results/README.md from the JSON records there: the latest figure of every benchmark on
every device, each with its file, and the peer table (kvtool beside llama.cpp, vLLM and transformers) that the
project README shows between its results markers.

    python -m kvtool.bench.results_index            # rewrite both
    python -m kvtool.bench.results_index --check    # exit 1 if either is out of date
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable

BEGIN, END = "<!-- results:begin (python -m kvtool.bench.results_index) -->", "<!-- results:end -->"
HEADLINES: dict[str, Callable[[dict], str]] = {}


def headline(*names: str):
    def register(fn):
        for name in names:
            HEADLINES[name] = fn
        return fn

    return register


def _x(v) -> str:
    return "n/a" if v is None else f"{v:.2f}x"


def _n(v, unit: str = "") -> str:
    if v is None:
        return "n/a"
    text = f"{v:,.0f}" if abs(v) >= 100 else f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}"
    return f"{text} {unit}".rstrip()


@headline("decode")
def _decode(r):
    res, sp = r["results"], r["speedup_vs_transformers"]
    out = (f"bs=1 decode {_n(res['decode_tok_s']['kvtool']['median'], 'tok/s')} "
           f"({_x(sp.get('decode_tok_s'))} transformers)")
    if "decode_tok_s_int4" in res:
        out += f", int4 {_n(res['decode_tok_s_int4']['kvtool']['median'], 'tok/s')} ({_x(sp.get('decode_tok_s_int4'))})"
    ttft = [m for m in res if m.startswith("ttft_ms_") and m.count("_") == 2]
    return out + "; cold TTFT " + ", ".join(f"@{m[8:]} {_n(res[m]['kvtool']['median'], 'ms')} ({_x(sp.get(m))})"
                                            for m in ttft)


@headline("prefix")
def _prefix(r):
    k = r["results"]["kvtool"]
    return (f"{r['config']['prefix_tokens']}-token prefix hit {_n(k['hit_ms']['median'], 'ms')}, "
            f"{_x(k['speedup'])} cold; {_x(r.get('hit_vs_transformers_hit'))} transformers' hit")


@headline("batching")
def _batching(r):
    c, k = r["config"], r["results"]["kvtool"]
    return (f"{c['streams']} streams x {c['new_tokens']}: {_n(k['tok_s']['median'], 'tok/s')}, ITL p99 "
            f"{_n(k['itl_ms_p99'], 'ms')} ({_x(r['speedup_vs'].get('transformers'))} transformers)")


@headline("ttft")
def _ttft(r):
    rows = [s for s in r["scenarios"] if s["hit_rate_after_first"] is not None]
    return "cached after 1st: " + ", ".join(f"{s['name']} {100 * s['hit_rate_after_first']:.0f}%" for s in rows)


@headline("serve_load")
def _serve_load(r):
    return (f"{r['clients']} clients {r['seconds']:.0f} s: {r['completed']}/{r['requests']} done, "
            f"{_n(r['tokens_per_s'], 'tok/s')}, TTFT p50 {_n(r['ttft_p50_ms'], 'ms')}, "
            f"p99 {_n(r['ttft_p99_ms'], 'ms')}")


@headline("skills")
def _skills(r):
    best = max(r["repairs"], key=lambda x: x.get("speedup_cold") or 0)
    return f"composed skills vs full prefill: up to {_x(best.get('speedup_cold'))} TTFT ({best['repair']})"


def _pct(v) -> str:
    return "n/a" if v is None else f"{100 * v:.0f}%"


def _share(ops: list[dict], *names: str) -> float:
    total = sum(o["self_ms"] for o in ops) or 1.0
    return sum(o["self_ms"] for o in ops if any(n in o["op"] for n in names)) / total


HEADLINES.update({  # one-line summaries
    "prefill_profile": lambda r: f"{r['tokens']}-token cold prefill {_n(r['wall_ms']['kvtool']['median'], 'ms')} "
                                 f"({_x(r['transformers_vs_kvtool'])} transformers); kvtool's op time: GEMMs "
                                 f"{100 * _share(r['kvtool_ops'], 'linear', '::mm'):.0f}%, attention "
                                 f"{100 * _share(r['kvtool_ops'], 'attention'):.0f}%",
    "prefill_engines": lambda r: "; ".join(
        f"{pair.replace('_over_', ' / ')}: " + ", ".join(f"cold TTFT @{m[13:]} {_x(row[m]['median'])}"
                                                        for m in row if m.startswith("cold_ttft_ms_"))
        for pair, row in r["ratios"].items()),
    "shared_prefix": lambda r: f"TTFT {_x(r['ttft_speedup'])}, wall {_x(r['wall_speedup'])} vs caching only "
                               "finished requests",
    "choices": lambda r: f"n={r['n']} in one request: wall {_x(r['speedup_wall'])}, last TTFT "
                         f"{_x(r['speedup_last_ttft'])}",
    "json_mode": lambda r: ", ".join(f"{k}: {v['fit_schema']}/{v['requests']} fit the schema"
                                     for k, v in r["results"].items()) if "results" in r else "; ".join(
        f"{name}: " + (", ".join(f"{path} overhead {100 * m[path]['overhead']:+.1f}%" for path in
                                 ("batch1", "streams8") if path in m) or
                       f"sampling {m['text']['median']:.2f} -> {m['json_schema']['median']:.2f} ms/token, 8 streams "
                       f"{m['streams8_step']['text']['median']:.1f} -> {m['streams8_step']['json_schema']['median']:.1f}"
                       " ms/step") for name, m in r["models"].items()),
    "agent_eval": lambda r: f"tool-call success {r['passed']}/{r['cases']}",
    "viz_8k": lambda r: f"{r['tokens']}-token heatmap peak RSS {r['peak_rss_gb']} GB",
    "engines": lambda r: "kvtool / vLLM: " + ", ".join(f"{k} {_x(v['median'])}"
                                                      for k, v in r["ratios_kvtool_over_vllm"].items()),
    "edit": lambda r: "; ".join(f"{mode}: the edit changes {v['edit_changes_answer']}/{v['cases']} answers, "
                                f"field_only recovers {_pct(v['field_only_recovers'])}, erratum "
                                f"{_pct(v['erratum_recovers'])}" for mode, v in r["verdict"].items()),
})


@headline("peers")
def _peers(r):
    ok = [n for n, e in r["engines"].items() if e["status"] == "ok"]
    rows = {t["target"]: t for t in r.get("targets", [])}
    met = sum(t["status"] == "met" for t in rows.values())
    return f"engines {', '.join(ok)}; targets met {met}/{len(rows)}"


def kind(record: dict) -> str | None:
    return record.get("benchmark") or record.get("bench")


def record_date(path: Path, record: dict) -> str:
    """The record's own date ('-' for records that carry none): the index depends on the files alone, not on
    when a checkout was made or how much git history it has."""
    date = record.get("date") or record.get("time")
    return str(date)[:10] if date else "-"


def load_records(folder: Path) -> list[tuple[Path, dict]]:
    out = []
    for path in sorted(folder.rglob("*.json")):
        if path.name == "partial.json" or "-quick" in str(path.relative_to(folder)):
            continue  # unfinished runs and smoke tests are not results
        try:
            record = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(record, dict) and kind(record):
            out.append((path, record))
    return out


def latest(records: list[tuple[Path, dict]]) -> list[tuple[Path, dict, str]]:
    """The newest record per (benchmark, model, device, variant file name without its date)."""
    import re

    best: dict[tuple, tuple[Path, dict, str]] = {}
    for path, rec in records:
        # the file's name without a date stamp, and its folder's (report.json files live in one folder per run kind)
        variant = re.sub(r"-?\d{8}-\d{6}", "", f"{path.parent.name}/{path.stem}")
        key = (kind(rec), rec.get("model"), str(rec.get("device")), variant)
        date = record_date(path, rec)
        if key not in best or (date, path.name) > (best[key][2], best[key][0].name):
            best[key] = (path, rec, date)
    return sorted(best.values(), key=lambda x: (kind(x[1]), x[0].name))


# ---- the peer table -----------------------------------------------------------------------------

PEER_COLUMNS = ("kvtool", "kvtool-int4", "llama.cpp", "vllm", "transformers")


def peer_rows(record: dict) -> list[list[str]]:
    """One row per workload: each engine's figure (its weights in the header), the file's engines in columns."""
    engines, c = record["engines"], record["config"]

    def cell(name, get):
        e = engines.get(name)
        if e is None:
            return "not run"
        if e["status"] != "ok":
            return e["status"]
        try:
            return get(e["results"])
        except (KeyError, TypeError):
            return "n/a"

    workloads = [(f"decode bs=1, {c['decode_tokens']} tokens (tok/s)", lambda r: _n(r["decode_tok_s"]["median"]))]
    workloads += [(f"cold TTFT @{n} (ms)", lambda r, n=n: _n(r[f"ttft_ms_{n}"]["median"])) for n in c["ttft_lengths"]]
    workloads.append((f"prefix hit {c['prefix_tokens']}+{c['suffix_tokens']} (ms; cached tokens)",
                      lambda r: f"{_n(r['prefix_hit_ms']['median'])}; {r['prefix_cached_tokens']}"))
    workloads += [(f"{n} streams x {c['stream_tokens']} (tok/s; ITL p99 ms)",
                   lambda r, n=n: f"{_n(r[f'streams_{n}']['tok_s']['median'])}; {_n(r[f'streams_{n}']['itl_ms_p99'])}")
                  for n in c["streams"]]
    workloads.append(("context layouts: mean cached after 1st",
                      lambda r: f"{100 * _mean([x['hit_rate_after_first'] for x in r['layouts'].values()]):.0f}%"))
    rows = [[label, *[cell(n, get) for n in PEER_COLUMNS]] for label, get in workloads]
    rows = [r for r in rows if any(c not in ("n/a", "not run", "missing", "failed") for c in r[1:])]
    # other work on the machine while each engine ran (the 1-minute load average at its start and end)
    load = ["/".join(f"{x:.1f}" for x in engines[n].get("load_avg", [])) or "-" if n in engines else "-"
            for n in PEER_COLUMNS]
    return rows + [["load average (start/end)", *load]]


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs)


def peer_table(path: Path, record: dict, link: str) -> list[str]:
    engines = record["engines"]
    head = ["workload", *[f"{n} ({engines[n].get('weights', '')})" if n in engines else n for n in PEER_COLUMNS]]
    lines = [f"{record['model']} on {record['device']}, {record['date'][:10]} ([{path.name}]({link})):", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in peer_rows(record)]
    lines += ["", "Targets: " + "; ".join(f"{t['target']}: {_x(t['ratio'])} ({t['status']})"
                                          for t in record.get("targets", []))]
    return lines


# ---- writing ------------------------------------------------------------------------------------


def results_readme(folder: Path) -> str:
    rows = latest(load_records(folder))
    lines = ["# Recorded results", "",
             "Generated by `python -m kvtool.bench.results_index` from the JSON records in this folder: the latest "
             "record of each benchmark per model and device. Every figure comes from the file named beside it.", "",
             "| benchmark | model | device | date | headline | file |", "|---|---|---|---|---|---|"]
    for path, rec, date in rows:
        fn = HEADLINES.get(kind(rec))
        try:
            text = fn(rec) if fn else "see the file"
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
            text = f"(record not summarised: {type(exc).__name__} {exc})"
        rel = path.relative_to(folder)
        model = rec["model"] if isinstance(rec.get("model"), str) else "-"
        model = Path(model).name if model.startswith("/") else model  # a file path: its name
        lines.append(f"| {kind(rec)} | {model} | {rec.get('device', '-')} | {date} | {text} | [{rel}]({rel}) |")
    peers = [(p, r) for p, r, _ in rows if kind(r) == "peers"]
    for path, rec in peers:
        lines += ["", f"## Peers: {rec['model']}", "", *peer_table(path, rec, str(path.relative_to(folder)))]
    return "\n".join(lines) + "\n"


RATIO_METRICS = (("decode_tok_s", "decode bs=1 (tok/s)"), ("ttft_ms_", "cold TTFT @{} tokens"),
                 ("prefix_hit_ms", "prefix hit TTFT"), ("streams_", "{} streams (tok/s)"))
RATIO_PEERS = (("llama.cpp", "llama.cpp"), ("vllm", "vLLM"), ("transformers", "transformers"))


def _ratio_label(metric: str) -> str | None:
    """The README row of a peer ratio; None for the ratios it leaves to the full tables (ITL, layouts)."""
    for key, label in RATIO_METRICS:
        if metric == key:
            return label
        if key.endswith("_") and metric.startswith(key):
            arg = metric[len(key):].removesuffix("_tok_s")
            if arg.isdigit() and (key == "ttft_ms_" or metric.endswith("_tok_s")):
                return label.format(arg)
    return None


def ratio_rows(path: Path, record: dict, link: str) -> list[str]:
    """One row per workload: the better kvtool variant's ratio against each peer (above 1: kvtool ahead)."""
    best: dict[str, dict[str, tuple[float, str]]] = {}
    for variant, peers in record.get("ratios", {}).items():
        for peer, metrics in peers.items():
            for metric, ratio in metrics.items():
                if ratio is not None and _ratio_label(metric):
                    cell = best.setdefault(metric, {})
                    if peer not in cell or ratio > cell[peer][0]:
                        cell[peer] = (ratio, variant)
    loads = [x for e in record["engines"].values() for x in e.get("load_avg", [])]
    load = f", load {min(loads):.1f}-{max(loads):.1f}" if loads else ""
    run = f"{record['model']}, {record['date'][:10]}{load} ([{path.parent.name}]({link}))"
    rows = []
    for metric, cells in best.items():
        peers = [f"{cells[p][0]:.2f}x ({cells[p][1]})" if p in cells else "-" for p, _ in RATIO_PEERS]
        rows.append(f"| {run if not rows else ''} | {_ratio_label(metric)} | " + " | ".join(peers) + " |")
    return rows


def readme_block(folder: Path, readme: Path) -> str:
    """The project README's results block: one table of kvtool's ratios against its peers, from the latest
    `kvtool bench peers` records, linked from the README's folder."""
    peers = [(p, r) for p, r, _ in latest(load_records(folder)) if kind(r) == "peers"]
    lines = [BEGIN, ""]
    rows = [row for path, rec in peers for row in ratio_rows(path, rec, str(path.relative_to(readme.parent)))]
    if rows:
        lines += ["| run | workload | " + " | ".join(f"vs {name}" for _, name in RATIO_PEERS) + " |",
                  "|---|---|" + "---|" * len(RATIO_PEERS), *rows, "",
                  "Each cell is the better kvtool variant (fp32 `kvtool`, `kvtool-int4`) against the peer in the same "
                  "run: tok/s over tok/s, or the peer's TTFT over kvtool's, so above 1 kvtool is ahead. The load "
                  "average is the machine's 1-minute load while the engines ran (2 cores).", ""]
        for path, rec in peers:
            lines.append(f"- {path.parent.name}: " + "; ".join(f"{t['target']}: {_x(t['ratio'])} ({t['status']})"
                                                              for t in rec.get("targets", []) if t["ratio"] is not None))
    else:
        lines.append("(no `kvtool bench peers` record yet)")
    rel = folder.relative_to(readme.parent)
    lines += ["", f"Every engine's figures and every benchmark's latest record, each with its file: "
                  f"[{rel}/README.md]({rel}/README.md).", END]
    return "\n".join(lines)


def update(folder: Path, readme: Path | None, check: bool = False) -> list[str]:
    """Rewrite (or, with check, compare) the results README and the README's block; the files out of date."""
    stale = []
    target, text = folder / "README.md", results_readme(folder)
    if not target.exists() or target.read_text() != text:
        stale.append(str(target))
        if not check:
            target.write_text(text)
    if readme is not None and readme.exists():
        body = readme.read_text()
        if BEGIN in body and END in body:
            head, rest = body.split(BEGIN, 1)
            new = head + readme_block(folder, readme) + rest.split(END, 1)[1]
            if new != body:
                stale.append(str(readme))
                if not check:
                    readme.write_text(new)
    return stale


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvtool.bench.results_index", description=__doc__.split("\n\n")[0])
    p.add_argument("--results", default="benchmarks/results", help="the folder of JSON records")
    p.add_argument("--readme", default="README.md", help="the README with the results markers ('' for none)")
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if a file is out of date")
    args = p.parse_args(argv)
    stale = update(Path(args.results), Path(args.readme) if args.readme else None, args.check)
    for path in stale:
        print(f"{'out of date' if args.check else 'wrote'} {path}", file=sys.stderr)
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
