"""The text of the `kvtool bench all` report: number formatting, one markdown section per benchmark, and
report.md itself (kvtool.bench.report runs the benchmarks, draws the plots and writes the files)."""

from __future__ import annotations

import re
from pathlib import Path

from kvtool.bench.decode import paired_text, variant_of


def _num(x, unit: str = "") -> str:
    if x is None:
        return "n/a"
    text = f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.1f}" if abs(x) >= 10 else f"{x:.2f}"
    return f"{text} {unit}".rstrip()


def _stat(s: dict | None) -> str:
    """median (min-max over n runs)."""
    if not s:
        return "n/a"
    return _num(s["median"]) + (f" ({_num(s['min'])}-{_num(s['max'])})" if s["n"] > 1 else "")


def _ratio(x) -> str:
    return "n/a" if x is None else f"{x:.2f}x"


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]


def _decode_md(records: dict) -> list[str]:
    rec = records["decode"]
    c, ratios, paired = rec["config"], rec["speedup_vs_transformers"], rec.get("paired_speedup_vs_transformers", {})
    rows = []
    for metric, row in rec["results"].items():
        base, variant = variant_of(metric)
        label = ("decode tok/s (bs=1)" if base.startswith("decode") else f"cold TTFT @{base[8:]} tokens (ms)") + \
            (f", {variant.removeprefix('kvtool ')}" if variant else "")
        rows.append([label, _stat(row["kvtool"]), _stat(row.get("transformers")), _ratio(ratios.get(metric)),
                     paired_text(paired.get(metric))])
    lines = [f"{c['decode_tokens']} greedy tokens after a {c['prompt_tokens']}-token prompt; median (min-max) of "
             f"{c['repeats']} runs after {c['warmup']} warm-up, the engines alternating run by run. Ratio > 1: kvtool "
             "is faster; run by run: each kvtool run against the baseline run beside it.", "",
             *_table(["metric", "kvtool", "transformers", "kvtool vs transformers", "run by run"], rows)]
    for name, what in (("int4", "int4 projections"), ("bf16", "bf16 weights")):
        if fid := rec.get(f"{name}_fidelity"):
            lines += ["", f"{what} vs the dense model over {fid['steps']} greedy steps: top-1 agreement "
                          f"{fid['top1_agreement']:.3f}, next-token KL mean {fid['kl_mean']:.5f} (max {fid['kl_max']:.5f})"
                          + (f"; top-1 agreement over one prefill of the prompt and those tokens "
                             f"{fid['prefill_top1_agreement']:.3f}" if "prefill_top1_agreement" in fid else "") + "."]
    return lines


def _ttft_md(records: dict) -> list[str]:
    runs = {name: records[key] for name, key in (("kvtool", "ttft"), ("endpoint", "ttft_endpoint")) if key in records}
    by_name = {name: {r["name"]: r for r in rec["scenarios"]} for name, rec in runs.items()}
    pct = lambda x: "n/a" if x is None else f"{100 * x:.0f}%"  # noqa: E731
    head, rows = ["scenario", "expect"], []
    for name in runs:
        head += [f"{name} TTFT p50 (ms)", f"{name} hit after 1st"]
    if len(runs) == 2:
        head.append("endpoint / kvtool TTFT")
    first = next(iter(runs.values()))
    for sc in first["scenarios"]:
        row = [f"{sc['number']} {sc['name']}", sc["expect"]]
        found = [by_name[n].get(sc["name"]) for n in runs]
        for r in found:
            row += [_num(r and r["ttft_ms_p50"]), pct(r and r["hit_rate_after_first"])]
        if len(found) == 2:
            row.append(_ratio(found[1]["ttft_ms_p50"] / found[0]["ttft_ms_p50"] if all(found) else None))
        rows.append(row)
    where = ", ".join(f"{n}: {rec.get('endpoint') or rec['backend']} ({rec['model']})" for n, rec in runs.items())
    return [f"Each scenario from an empty cache, {first['scenario_config']['requests']} requests; {where}. "
            "transformers keeps no KV cache across requests, so it has no column here.", "",
            *_table(head, rows)]


def _prefix_md(records: dict) -> list[str]:
    rec = records["prefix"]
    c = rec["config"]
    rows = [[e, _stat(r["cold_ms"]), _stat(r["hit_ms"]), _ratio(r["speedup"])] for e, r in rec["results"].items()]
    tail = [f"kvtool hit vs transformers hit: {_ratio(rec['hit_vs_transformers_hit'])}"] \
        if "hit_vs_transformers_hit" in rec else []
    return [f"{c['prefix_tokens']} cached + {c['suffix_tokens']} new tokens; first token after a hit equals a "
            f"cold prefill's: {rec['first_token_match']}.", "",
            *_table(["engine", "cold prefill (ms)", "prefix hit (ms)", "hit speedup"], rows), "", *tail]


def _skills_md(records: dict) -> list[str]:
    rec = records["skills"]
    rows = [[r["repair"], r.get("preamble", ""), f"{100 * r['recomputed_fraction']:.1f}%", f"{r['top1']:.3f}",
             f"{r['cos_mean']:.4f}", _stat(r["ttft_ms_cold"]), _ratio(r["speedup_cold"])] for r in rec["repairs"]]
    return [f"{rec['prompt_tokens']} prompt tokens ({rec['block_tokens']} in {len(rec['blocks'])} blocks); baseline: "
            f"kvtool full prefill of the same tokens, TTFT {_stat(rec['ttft_ms_full'])} ms"
            + (" (random weights: fidelity numbers are not meaningful)" if rec["random_weights"] else
               " (synthetic token blocks)" if rec.get("synthetic_blocks") else "") + ".", "",
            *_table(["repair", "blocks compiled", "recomputed", "top-1", "cosine", "TTFT cold (ms)",
                     "vs full prefill"], rows)]


def _batching_md(records: dict) -> list[str]:
    from kvtool.bench.batching import ENGINES

    rec = records["batching"]
    c, speedup = rec["config"], rec["speedup_vs"]
    rows = [[ENGINES[n], str(r["streams"]), _stat(r["tok_s"]), _num(r["itl_ms_p50"]), _num(r["itl_ms_p99"]),
             _num(r["ttft_ms_p50"]), _num(r["ttft_ms_p99"]), _ratio(speedup.get(n))]
            for n, r in rec["results"].items()]
    match = "; ".join(f"{ENGINES[n]}: {m['identical']}/{m['compared']}" for n, m in rec["greedy_match"].items())
    endpoint = rec["endpoint"]
    return [f"{c['streams']} concurrent greedy streams x {c['new_tokens']} new tokens (ignore_eos), random prompts of "
            f"{min(rec['prompt_lengths'])}-{max(rec['prompt_lengths'])} tokens"
            + (f"; endpoint {endpoint['url']} ({endpoint['model']})" if endpoint else "") + ".", "",
            *_table(["engine", "streams", "output tok/s", "ITL p50 (ms)", "ITL p99 (ms)", "TTFT p50 (ms)",
                     "TTFT p99 (ms)", "kvtool batched vs this"], rows), "",
            f"Greedy streams identical to kvtool batched: {match or 'not compared'}. Sequential TTFT is per lone "
            "request; endpoint ITL is between streamed chunks."]


SECTIONS = {"decode": ("Decode (bs=1) and cold TTFT", _decode_md),
            "ttft": ("TTFT per context layout (prefix-cache scenarios)", _ttft_md),
            "prefix": ("Prefix-cache hit vs cold prefill", _prefix_md),
            "skills": ("Composed skill blocks vs full prefill", _skills_md),
            "batching": ("Concurrent streams (continuous batching)", _batching_md)}


def markdown(record: dict, plots: dict[str, str]) -> str:
    v, records, errors = record["versions"], record["records"], record["errors"]
    endpoint = record["config"]["endpoint"]
    lines = [f"# kvtool benchmark report: {record['model']} on {record['device']}", "",
             *_table(["", ""], [["model", record["model"] + (" (random weights)" if record["random_weights"] else "")],
                                ["device", f"{record['device']} ({record['device_type']})"],
                                ["dtype", record["dtype"]],
                                ["versions", f"python {v['python']}, torch {v['torch']}, transformers "
                                             f"{v['transformers']}, kvtool {v['kvtool']}"],
                                ["date", record["date"]],
                                ["mode", "quick (tiny sizes: a smoke test, not a measurement)" if record["config"][
                                    "quick"] else "full"],
                                ["endpoint", endpoint or "none"],
                                ["command", f"`{record['command']}`"]]),
             "", "## Targets", "",
             "Measured values come from this run; n/a where a target was set for another device or size "
             "(the sizes of a full run), or nothing was measured.", ""]
    rows = [[t["benchmark"], t["label"], t["target"], t["setup"], _num(t["measured"], t["unit"]), t["status"]]
            for t in record["targets"]]
    lines += _table(["benchmark", "metric", "target", "set for", "measured", "status"], rows) if rows else \
        ["(no targets ran)"]
    for name in record["config"]["only"]:
        title, section = SECTIONS[name]
        lines += ["", f"## {title}", ""]
        if any(key.split("_")[0] == name for key in records):
            lines += section(records)
        lines += [f"\n![{key}]({Path(path).name})" for key, path in plots.items() if key.split("_")[0] == name]
        lines += [f"\n**error ({key}):** `{msg}`" for key, msg in errors.items() if re.split("[_ ]", key)[0] == name]
        spent = sum(t for key, t in record["seconds"].items() if key.split("_")[0] == name)
        lines.append(f"\n_{spent:.0f} s_")
    return "\n".join(lines) + "\n"
