"""The `kvtool bench peers` report: ratios of kvtool to each peer, the issue's targets met or missed, and
report.md (tables), PNG plots and report.json (the record, also the last stdout line)."""

from __future__ import annotations

from pathlib import Path

import json

from kvtool.bench.peers.judge import CLIENT_ROWS, ROW_METRICS, best, client_load, pairs, ratios, targets
from kvtool.bench.peers.roofline import not_measured, roofline_rows
from kvtool.bench.peers.rounds import figure
from kvtool.bench.peers.vllm_client import result_key
from kvtool.bench.protocol import emit, portable
from kvtool.bench.report_md import _num, _ratio, _stat, _table

# ---- markdown ---------------------------------------------------------------------------------


def _engine_rows(engines: dict, fn) -> list[list[str]]:
    return [[n, e.get("weights", ""), *fn(e["results"])] for n, e in engines.items()
            if e.get("status") == "ok" and e.get("results")]


def _single_md(record: dict) -> list[str]:
    c, engines = record["config"], record["engines"]
    lengths = c["ttft_lengths"]
    head = ["engine", "weights", f"decode tok/s (bs=1, {c['decode_tokens']} tokens)",
            *[f"cold TTFT @{n} (ms)" for n in lengths], f"prefix hit TTFT (ms, {c['prefix_tokens']}+"
            f"{c['suffix_tokens']})", "cached tokens reported"]

    def cells(r):
        cached = "n/a" if r.get("prefix_cached_tokens") is None else \
            f"{r['prefix_cached_tokens']}/{r['prefix_prompt_tokens']}"
        return [_stat(r.get("decode_tok_s")), *[_stat(r.get(f"ttft_ms_{n}")) for n in lengths],
                _stat(r.get("prefix_hit_ms")), cached if "prefix_hit_ms" in r else "n/a"]

    return _table(head, _engine_rows(engines, cells))


def _streams_md(record: dict) -> list[str]:
    c, rows = record["config"], []
    for n in c["streams"]:
        rows += [[f"{n}", name, e["weights"], _stat(r["tok_s"]), _num(r["itl_ms_p50"]), _num(r["itl_ms_p99"]),
                  _num(r["ttft_ms_p50"])]
                 for name, e in record["engines"].items() if (r := (e.get("results") or {}).get(f"streams_{n}"))]
    return [f"{c['stream_tokens']} greedy tokens per stream (ignore_eos), random prompts of up to "
            f"{c['stream_prompt_tokens']} tokens; endpoint ITL is between streamed chunks.", "",
            *_table(["streams", "engine", "weights", "output tok/s", "ITL p50 (ms)", "ITL p99 (ms)",
                     "TTFT p50 (ms)"], rows)]


def _layouts_md(record: dict) -> list[str]:
    have = {n: e["results"]["layouts"] for n, e in record["engines"].items()
            if "layouts" in (e.get("results") or {})}
    if not have:
        return ["(no engine ran the context layouts)"]
    pct = lambda x: "n/a" if x is None else f"{100 * x:.0f}%"  # noqa: E731
    head = ["scenario", "expect"] + [f"{n} {what}" for n in have for what in ("TTFT p50 (ms)", "cached after 1st")]
    rows = []
    for sc in record["config"]["scenarios"]:
        first = next(iter(have.values())).get(sc)
        row = [f"{first['number']} {sc}" if first else sc, first["expect"] if first else ""]
        for layouts in have.values():
            r = layouts.get(sc)
            row += [_num(r and r["ttft_ms_p50"]), pct(r and r["hit_rate_after_first"])]
        rows.append(row)
    return [f"Each scenario from an empty cache (or a fresh nonce), {record['config']['scenario_requests']} chat "
            "requests; cached after 1st = prompt tokens the engine reported cached / prompt tokens, over the "
            "requests after the first.", "", *_table(head, rows)]


def _ratios_md(record: dict) -> list[str]:
    lines = []
    for k, peers in record["ratios"].items():
        names = list(peers)
        ms = list(dict.fromkeys(m for p in peers.values() for m in p))
        rows = [[m, *[_ratio(peers[p].get(m)) for p in names]] for m in ms]
        lines += ["", f"**{k}** vs each engine (> 1: {k} is faster, or caches more):", "",
                  *_table(["metric", *names], rows)]
    return lines


def spread_text(row: dict, path: str) -> str:
    """A figure of an engine's entry as median (min-max over the rounds)."""
    f = figure(row, path)
    if f is None:
        return "n/a"
    lo, hi = _num(f[1]), _num(f[2])
    return _num(f[0]) + (f" ({lo}-{hi})" if lo != hi else "")


def _memory_md(record: dict) -> list[str]:
    engines = record["engines"]
    rows = [[n, e.get("weights", ""), spread_text(e, "memory.rss_mib"), spread_text(e, "memory.pss_mib"),
             _processes_text(e["results"]["memory"]), _alone_text(e, engines),
             (e.get("budgets") or {}).get("kv", "n/a"), (e.get("budgets") or {}).get("prefix_cache", "n/a")]
            for n, e in engines.items() if "memory" in (e.get("results") or {})]
    if not rows:
        return ["(no engine ran the memory workload)"]
    return ["Resident memory of each server's process tree, from /proc, after one request: RSS, and PSS (a page "
            "two of its processes share counted once); the budgets are the ones this run started it with. An engine "
            "run behind kvtool's server (kvtool-vllm) is read against the same engine's own server in this run "
            "(its RSS / theirs, medians).", "",
            *_table(["engine", "weights", "RSS (MiB)", "PSS (MiB)", "processes (RSS MiB)", "vs the engine alone",
                     "KV budget", "prefix-cache budget"], rows)]


def _processes_text(memory: dict) -> str:
    names = memory.get("by_name") or {}
    return f"{memory['processes']}" + (f": {', '.join(f'{n} {_num(v)}' for n, v in names.items())}" if names else "")


def _alone_text(entry: dict, engines: dict) -> str:
    """entry's median RSS over that of the engine it runs alone (entry["alone"]) in the same record, else "-"."""
    alone = engines.get(entry.get("alone") or "")
    ours, theirs = figure(entry, "memory.rss_mib"), alone and figure(alone, "memory.rss_mib")
    if not (ours and theirs and theirs[0]):
        return "-"
    return f"{ours[0] / theirs[0]:.3f}x {entry['alone']}"


VLLM_BENCH_COLUMNS = (("output tok/s", "output_throughput"), ("TTFT median (ms)", "median_ttft_ms"),
                      ("TTFT p90 (ms)", "p90_ttft_ms"), ("TTFT p99 (ms)", "p99_ttft_ms"),
                      ("TPOT median (ms)", "median_tpot_ms"), ("TPOT p99 (ms)", "p99_tpot_ms"),
                      ("ITL p99 (ms)", "p99_itl_ms"), ("E2E median (ms)", "median_e2el_ms"))


def client_load_text(config: dict, workload: str) -> str:
    """A `bench serve` workload's sizes as the record's config gives them: 32 x 0+512 -> 128 tokens, 16 at once."""
    load = client_load(config, workload)
    return (f"{load['prompts']} x {load['prefix_tokens']}+{load['input_tokens']} -> {load['output_tokens']} tokens, "
            f"{load['concurrency']} at once")


def _vllm_bench_md(record: dict) -> list[str]:
    rows, command = [], None
    for w in CLIENT_ROWS:
        key = result_key(w)
        for n, e in record["engines"].items():
            if key in (e.get("results") or {}):
                rows.append([w, n, e.get("precision", ""),
                             *[spread_text(e, f"{key}.{k}") for _, k in VLLM_BENCH_COLUMNS]])
                command = command or e["results"][f"{key}_command"]
    if not rows:
        return ["(no engine ran vLLM's client)"]
    loads = "; ".join(f"{w}: {client_load_text(record['config'], w)}" for w in CLIENT_ROWS
                      if w in record["config"]["workloads"])
    return [f"vLLM's own client (`vllm bench serve`, random dataset, ignore_eos, greedy), prompts of shared prefix + "
            f"random tokens -> tokens out: {loads}. One of its commands (the base URL, model and sizes differ per "
            "engine and workload):", "", f"`{command}`", "",
            *_table(["workload", "engine", "precision", *[label for label, _ in VLLM_BENCH_COLUMNS]], rows)]


def equal_table(record: dict) -> tuple[list[str], list[list[str]]]:
    """kvtool against each peer of its precision, then each engine's best against kvtool's best (record["pairs"],
    record["best"]): (header, rows), one row per workload, a `bench serve` cell giving the four ratios the targets
    judge; no rows where no kvtool variant ran beside a peer."""
    cols = [(f"{p['kvtool']} / {p['peer']}, {p['precision']}", p["ratios"]) for p in record.get("pairs", [])]
    cols += [(f"kvtool best / {fam} best", {m: v["ratio"] for m, v in rows.items()})
             for fam, rows in record.get("best", {}).items()]
    lines = [("decode bs=1 (tok/s)", ["decode_tok_s"])] * ("decode" in record["config"]["workloads"]) + [
        (f"{w}: {client_load_text(record['config'], w)}", [f"{result_key(w)}_{m}" for m in ROW_METRICS])
        for w in CLIENT_ROWS if w in record["config"]["workloads"]]
    rows = [[label, *[", ".join(_ratio(r.get(m)) for m in ms) for _, r in cols]] for label, ms in lines]
    return ["workload", *[c for c, _ in cols]], rows if cols else []


def threads_text(record: dict) -> str:
    n = record.get("threads")
    return f"{n} thread{'s' if n != 1 else ''}" if n else "threads not recorded"


def _equal_md(record: dict) -> list[str]:
    head, rows = equal_table(record)
    if not rows:
        return ["(no kvtool variant ran beside a peer)"]
    return [f"Ratios above 1 favour kvtool, at {threads_text(record)} for every engine; a `bench serve` row "
            f"gives {', '.join(ROW_METRICS.values())}.", "", *_table(head, rows)]


def _roofline_md(record: dict) -> list[str]:
    rows = roofline_rows(record)
    if rows is None:
        return [f"Roofline: {not_measured(record)}."]
    m, engines = record["roofline"]["machine"], record["roofline"]["engines"]
    pct = lambda r: f"{100 * r['fraction']:.0f}%"  # noqa: E731
    cells = [[r["engine"], r["row"], f"{r['bytes_per_token'] / 1e6:.1f} MB", f"{_num(r['limit_tok_s'])} tok/s",
              f"{_num(r['tok_s'])} tok/s", pct(r)] if "limit_tok_s" in r else
             [r["engine"], r["row"], f"{r['gflop']:.2f} GFLOP", f"{_num(r['peak_gflop_s'])} GFLOP/s ({r['gemm']})",
              f"{_num(r['gflop_s'])} GFLOP/s", pct(r)] for r in rows]
    probes = m.get("probes", [m])
    when = "before the first engine and after the last" if len(probes) > 1 else "before the first engine"
    loads = " and ".join(_num(p["load_1min"]) for p in probes)
    peaks = ", ".join(f"{_num(v)} GFLOP/s in {k}" for k, v in m["gemm_gflop_s"].items())
    return [f"The machine at {threads_text(m)}, probed {when} (load {loads}): a streaming read of {m['buffer_mib']} "
            f"MiB at {_num(m['bandwidth_gb_s'])} GB/s, a {m['gemm_size']}^2 matmul at {peaks}"
            f" (the fastest of {m['passes']} passes of each probe). A decode row's limit is that bandwidth over the "
            "bytes it reads a token (weights / rows + KV at its mean context); a cold TTFT's FLOPs over its time are "
            "read against the GEMM peak of the dtype the engine multiplies in (docs/benchmarks.md, \"Roofline\").", "",
            *_table(["engine", "row", "a token reads / prompt FLOPs", "limit / peak", "measured", "of the limit"],
                    cells), "", "Weights read: " + "; ".join(f"{n}: {v['source']}" for n, v in engines.items()) + "."]


def _load_line(record: dict) -> str:
    load = record.get("load") or {}
    if not load:
        return "No load samples."
    verdict = "quiet" if record.get("quiet") else "NOT quiet: the load passed the core count; the figures may be noisy"
    peaks = [(value, f"{name} round {run.get('round')}, {phase}")
             for name, e in (record.get("engines") or {}).items() for run in e.get("runs", [])
             for phase, value in ((run.get("load") or {}).get("max_by_phase") or {}).items()]
    where = f" The highest sample: {_num(max(peaks)[0])} in {max(peaks)[1]}." if peaks else ""
    others = "" if load.get("others_cpu_max") is None else (
        f" Processes outside the run kept at most {_num(load['others_cpu_max'])} cores busy between two samples.")
    return (f"1-minute load average sampled while the engines ran: {_num(load['min'])}-{_num(load['max'])} over "
            f"{load['samples']} samples on {load['cores']} cores: {verdict}.{where}{others}")


def markdown(record: dict, plots: dict[str, str]) -> str:
    v, engines = record["versions"], record["engines"]
    lines = [f"# kvtool vs peers: {record['model']} on {record['device']}", "",
             *_table(["", ""], [["model", f"{record['model']} (GGUF {record['gguf_type'] or 'none'})"],
                                ["device", f"{record['device']}, {record['threads']} threads for every engine"],
                                ["versions", f"python {v['python']}, torch {v['torch']}, transformers "
                                             f"{v['transformers']}, kvtool {v['kvtool']}"],
                                ["date", record["date"]],
                                ["mode", "quick (tiny sizes: a smoke test, not a measurement)"
                                 if record["config"]["quick"] else "full"],
                                ["command", f"`{record['command']}`"]]),
             "", "Servers run one at a time on the same model (no two engines of this run share the CPU; other work on "
                 f"the machine shows in the load average below), {record['config']['rounds']} rounds in alternating "
                 f"order ({', '.join(record.get('order', []))}). Each figure is the median (min-max) of the rounds; "
                 f"within a round, the median of {record['config']['repeats']} runs after "
                 f"{record['config']['warmup']} warm-up.", "",
             "## Engines", "",
             *_table(["engine", "what", "weights", "precision", "status", "rounds", "start-up (s)", "load min/max",
                      "why not / note"],
                     [[n, e.get("engine", ""), e.get("weights", ""), e.get("precision", ""), e["status"],
                       str(e.get("rounds", "")),
                       _num(e.get("startup_s")), "/".join(f"{x:.1f}" for x in e.get("load_avg", [])),
                       e.get("reason", "").split("\n")[0]] for n, e in engines.items()]),
             "", _load_line(record),
             "", "## Targets", "", *_table(["target", "ratio", "detail", "status"],
                                           [[t["target"], _ratio(t["ratio"]), t["detail"], t["status"]]
                                            for t in record["targets"]]),
             "", "## Equal precision", "", *_equal_md(record),
             "", "## Roofline", "", *_roofline_md(record),
             "", "## Decode, cold TTFT and prefix hit", "", *_single_md(record),
             "", "## Concurrent streams", "", *_streams_md(record),
             "", "## Context layouts", "", *_layouts_md(record),
             "", "## Memory", "", *_memory_md(record),
             "", "## vLLM bench serve", "", *_vllm_bench_md(record),
             "", "## Ratios", *_ratios_md(record)]
    if record.get("unfinished"):
        lines += ["", f"**Unfinished:** {', '.join(record['unfinished'])} had not run yet when this was written."]
    missing = [f"- {n}: {w}: {why.splitlines()[0]}" for n, e in engines.items()
               for w, why in (e.get("unsupported") or {}).items()]
    if missing:
        lines += ["", "## Workloads an engine did not run", "", *missing]
    lines += ["", *[f"![{k}]({Path(p).name})" for k, p in plots.items()]]
    return "\n".join(lines) + "\n"


# ---- plots ------------------------------------------------------------------------------------


def _plot_single(record, path):
    from kvtool.bench.plots import bar_panels

    ok = {n: e["results"] for n, e in record["engines"].items() if e.get("results")}
    panels = {"decode tok/s (bs=1)": {n: r["decode_tok_s"]["median"] for n, r in ok.items() if "decode_tok_s" in r}}
    for n in record["config"]["ttft_lengths"]:
        panels[f"cold TTFT @{n} (ms)"] = {e: r[f"ttft_ms_{n}"]["median"] for e, r in ok.items() if f"ttft_ms_{n}" in r}
    panels["prefix hit TTFT (ms)"] = {e: r["prefix_hit_ms"]["median"] for e, r in ok.items() if "prefix_hit_ms" in r}
    bar_panels(path, f"{record['model']} on {record['device']}", panels)


def _plot_streams(record, path):
    from kvtool.bench.plots import bar_panels

    ok = {n: e["results"] for n, e in record["engines"].items() if e.get("results")}
    panels = {}
    for n in record["config"]["streams"]:
        key = f"streams_{n}"
        panels[f"{n} streams: tok/s"] = {e: r[key]["tok_s"]["median"] for e, r in ok.items() if key in r}
        panels[f"{n} streams: ITL p99 (ms)"] = {e: r[key]["itl_ms_p99"] for e, r in ok.items() if key in r}
    bar_panels(path, f"concurrent streams: {record['model']}", panels)


def _plot_layouts(record, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    have = {n: e["results"]["layouts"] for n, e in record["engines"].items() if "layouts" in (e.get("results") or {})}
    names = record["config"]["scenarios"]
    fig, axes = plt.subplots(2, 1, figsize=(max(7, 1.3 * len(names)), 7), sharex=True)
    width = 0.8 / max(1, len(have))
    for i, (engine, layouts) in enumerate(have.items()):
        xs = [j + (i - (len(have) - 1) / 2) * width for j in range(len(names))]
        axes[0].bar(xs, [(layouts.get(s) or {}).get("ttft_ms_p50") or 0 for s in names], width, label=engine)
        axes[1].bar(xs, [100 * ((layouts.get(s) or {}).get("hit_rate_after_first") or 0) for s in names], width)
    axes[0].set_ylabel("TTFT p50 (ms)")
    if have:
        axes[0].legend(fontsize=8)
    axes[1].set_ylabel("prompt tokens cached after 1st (%)")
    axes[1].set_ylim(0, 105)
    axes[1].set_xticks(range(len(names)))
    axes[1].set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    axes[0].set_title(f"context layouts: {record['model']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


PLOTS = {"single": _plot_single, "streams": _plot_streams, "layouts": _plot_layouts}
PLOTTED = {"single": ("decode", "ttft", "prefix"), "streams": ("streams",), "layouts": ("layouts",)}  # workloads


def write_report(record: dict, out_dir: Path, log=print, quiet: bool = False) -> None:
    """report.md, the plots and report.json in out_dir; unless quiet (a report of the engines so far), the
    targets and the record (its last line) on stdout."""
    out_dir.mkdir(parents=True, exist_ok=True)
    record["ratios"] = ratios(record["engines"])
    record["pairs"], record["best"] = pairs(record["engines"]), best(record["engines"])
    record["targets"] = targets(record)
    if roofline_rows(record) is not None:
        record["roofline"]["rows"] = roofline_rows(record)
    plots, errors = {}, {}
    for key, draw in PLOTS.items():
        if not set(PLOTTED[key]) & set(record["config"]["workloads"]):
            continue  # nothing of this run to draw
        path = out_dir / f"peers-{key}.png"
        try:
            draw(record, path)
            plots[key] = str(path)
        except Exception as exc:  # a plot that fails is noted; the tables and the record still get written
            errors[key] = f"{type(exc).__name__}: {exc}"
    md = out_dir / "report.md"
    record["files"] = {"markdown": str(md), "json": str(out_dir / "report.json"), "plots": plots}
    if errors:
        record["plot_errors"] = errors
    md.write_text(markdown(record, plots))
    if quiet:
        (out_dir / "report.json").write_text(json.dumps(portable(record), indent=1) + "\n")
        return
    log(f"wrote {md} and {len(plots)} plots")
    for t in record["targets"]:
        print(f"target: {t['target']}: {_ratio(t['ratio'])} ({t['detail']}) -> {t['status']}")
    emit(record, out_dir / "report.json")
