"""Regenerate benchmarks/results/README.md from the JSON records there: the latest figure of every benchmark on
every device, each with its file, and the current peer figures (kvtool beside llama.cpp, vLLM and transformers)
whose ratios at equal precision the project README shows between its results markers.

    python -m kvtool.bench.results_index            # rewrite both
    python -m kvtool.bench.results_index --check    # exit 1 if either is out of date
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable

from kvtool.bench.results_peers import is_quiet, peer_table, quiet_block, ratio_block

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
    for name in ("int4", "bf16"):
        if f"decode_tok_s_{name}" in res:
            out += f", {name} {_n(res[f'decode_tok_s_{name}']['kvtool']['median'], 'tok/s')} " \
                   f"({_x(sp.get(f'decode_tok_s_{name}'))})"
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


@headline("skills_vllm")
def _skills_vllm(r):
    return "; ".join(f"{name}: p90 TTFT composed vs cold " + ", ".join(
        f"{e} {_x(row[e]['p90_speedup_compose_vs_cold'])} (hit {100 * row[e]['compose']['hit_rate']:.0f}%, top-1 "
        f"{100 * row[e]['compose']['top1_agreement']:.0f}%)" for e in ("vllm", "kvtool"))
        for name, row in r["models"].items())


@headline("skills_repair")
def _skills_repair(r):
    best = next((s for s in r["summary"] if s["repair"] == r["cheapest_meeting_bar"]), None)
    n = f" ({len(r['requests'])} requests)"
    return (f"cheapest repair meeting the fidelity bar: {best['label']}, {100 * best['uncomputed_share']:.1f}% of "
            "prompt tokens not computed" if best else "no repair meets the fidelity bar") + n


@headline("skill_breakeven")
def _skill_breakeven(r):
    return (f"{r.get('engine', 'kvtool')}: composition pays from {r['break_even_tokens'] or 'n/a'} block tokens "
            f"({r['repair']}); ") + "; ".join(
        f"{name}: composed vs prefilled " + ", ".join(f"@{row['block_tokens']} {_x(row['speedup']['median'])}"
                                                      for row in m["rows"])
        for name, m in r["models"].items())


def _pct(v) -> str:
    return "n/a" if v is None else f"{100 * v:.0f}%"


def _share(ops: list[dict], *names: str) -> float:
    total = sum(o["self_ms"] for o in ops) or 1.0
    return sum(o["self_ms"] for o in ops if any(n in o["op"] for n in names)) / total


HEADLINES.update({  # one-line summaries
    "prefill_profile": lambda r: (f"prefix hit on {r['prefix_tokens']} + {r['tokens']} new tokens"
                                  if r.get("prefix_tokens") else f"{r['tokens']}-token cold prefill")
                                 + f" {_n(r['wall_ms']['kvtool']['median'], 'ms')} "
                                 f"({_x(r['transformers_vs_kvtool'])} transformers); kvtool's op time: GEMMs "
                                 f"{100 * _share(r['kvtool_ops'], 'linear', '::mm'):.0f}%, attention "
                                 f"{100 * _share(r['kvtool_ops'], 'attention'):.0f}%",
    "server_cost": lambda r: "TPOT in the server / in process, same request: " + ", ".join(
        f"@{n} tokens {res['server_over_in_process']['median']:.3f} ({res['server_over_in_process']['min']:.2f}-"
        f"{res['server_over_in_process']['max']:.2f})" for n, res in r["results"].items()),
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
    "grammar_engines": lambda r: "; ".join(
        f"{name}: compiled llguidance {m['llguidance']['compiled']}/{m['schemas']}, xgrammar "
        f"{m['xgrammar']['compiled']}/{m['schemas']}; mask median {m['llguidance']['mask_us']['median']:.0f} vs "
        f"{m['xgrammar']['mask_us']['median']:.0f} µs, compile p90 {m['llguidance']['compile_ms']['p90']:.0f} vs "
        f"{m['xgrammar']['compile_ms']['p90']:.0f} ms" for name, m in r["models"].items()),
    "chunk_attention": lambda r: r.get("compares", "no mask over the masked form") + ": " + ", ".join(
        f"{row['prefix']}+{row['tokens']} {_x(row['speedup']['median'])}" for row in r["rows"]),
    "decode_products": lambda r: f"{r.get('weights', 'dense')}, the decode path's product over the other: " + ", ".join(
        f"{row['product']}@{row['rows']} {_x(row['taken_over_other']['median'])}"
        for row in r["rows"] if row["product"] in ("gate_up", "down")),
    "prefix_blocks": lambda r: f"a hit read in place over copied, {r['prefix']}+{r['suffix']}: TTFT "
                               f"{_x(r['ttft_speedup']['median'])}, {r['rows']}-row step {_x(r['step_speedup']['median'])}"
                               + (f", first tokens of {r['rows']} choices {_x(r['choices_speedup']['median'])}"
                                  if "choices_speedup" in r else ""),
    "agent_eval": lambda r: f"tool-call success {r['passed']}/{r['cases']}",
    "viz_8k": lambda r: f"{r['tokens']}-token heatmap peak RSS {r['peak_rss_gb']} GB",
    "engines": lambda r: "kvtool / vLLM: " + ", ".join(f"{k} {_x(v['median'])}"
                                                      for k, v in r["ratios_kvtool_over_vllm"].items()),
    "edit": lambda r: "; ".join(f"{mode}: the edit changes {v['edit_changes_answer']}/{v['cases']} answers, "
                                f"field_only recovers {_pct(v['field_only_recovers'])}, erratum "
                                f"{_pct(v['erratum_recovers'])}" + _at_1pct(v) for mode, v in r["verdict"].items()),
})


def _at_1pct(verdict: dict) -> str:
    at = verdict.get("at_1pct")
    if not at:
        return ""
    cost = f", {at['time_vs_full']:.2f}x full's time" if at.get("time_vs_full") else ""
    return f", attended 1% agrees with full on {_pct(at['agreement'])} ({_pct(at['fraction_recomputed'])} recomputed{cost})"


@headline("step_profile")
def _step_profile(r):
    def kind(s: dict) -> str:  # the fastest profiled step: the one a neighbour's load touched least
        step = s["fastest"]
        top = max((c for c in step["categories"] if c != "host"), key=step["categories"].get)
        return f"{_n(step['wall_ms'], 'ms')} ({top} {_pct(step['categories'][top] / step['wall_ms'])})"

    first: dict[str, dict] = {}
    for run in r["runs"]:  # each side's first round
        first.setdefault(run["side"], run)
    return (f"fastest {r['rows']}-row step, decode / +{r['arrivals']}x{r['prompt_tokens']} prefill: "
            + "; ".join(f"{side} {kind(run['decode'])} / {kind(run['mixed'])}" for side, run in first.items()))


@headline("peers")
def _peers(r):
    ok = [n for n, e in r["engines"].items() if e["status"] == "ok"]
    rows = {t["target"]: t for t in r.get("targets", [])}
    met = sum(t["status"] == "met" for t in rows.values())
    return (f"{'quiet' if is_quiet(r) else 'noisy'}: engines {', '.join(ok)}; targets met {met}/{len(rows)}")


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
    lines += ["", "## Current figures", "", "The quiet `kvtool bench peers` records behind the project README's ratios: "
              "per model, thread count and workload, the latest of each set of engines.", "",
              *quiet_block(peers, folder / "README.md")]
    for path, rec in peers:
        lines += ["", f"## Peers: {rec['model']}", "", *peer_table(path, rec, str(path.relative_to(folder)))]
    return "\n".join(lines) + "\n"


def readme_block(folder: Path, readme: Path) -> str:
    """The project README's results block: kvtool's ratios to its peers at equal precision in the latest quiet
    `kvtool bench peers` records (results_peers.ratio_block), the roofline, the skill and edit records."""
    peers = [(p, r) for p, r, _ in latest(load_records(folder)) if kind(r) == "peers"]
    rel = folder.relative_to(readme.parent)
    lines = [BEGIN, "", *ratio_block(peers), "", *family_rows(folder, readme), "",
             f"Every engine's figures behind these ratios, each record's command, and every record, quiet or noisy, "
             f"with its file: [{rel}/README.md]({rel}/README.md).", END]
    return "\n".join(lines)


FAMILY_KINDS = ("skills", "skills_vllm", "skill_breakeven", "edit")  # listed per model in the README


def family_rows(folder: Path, readme: Path) -> list[str]:
    """Skill fidelity and field-edit records, one row each (every model family measured), linked from the README."""
    rows = [(p, r) for p, r, _ in latest(load_records(folder)) if kind(r) in FAMILY_KINDS]
    if not rows:
        return []
    lines = ["Skill composition and field edits, per model:", "", "| benchmark | model | headline | file |",
             "|---|---|---|---|"]
    for path, rec in rows:
        link = str(path.relative_to(readme.parent))
        model = rec.get("model") or ", ".join(rec.get("models", ())) or "-"
        lines.append(f"| {kind(rec)} | {model} | {HEADLINES[kind(rec)](rec)} | [{path.name}]({link}) |")
    return lines


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
